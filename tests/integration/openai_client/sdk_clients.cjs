// The Vercel AI SDK (`ai` with `@ai-sdk/openai-compatible`) and LangChain (`@langchain/openai`)
// against tandem's OpenAI-compatible HTTP front door: each completes and streams a chat (greedy)
// and calls a tool. Prints one JSON object with the texts and calls; exits 1 when a client fails,
// its streamed text differs from its complete one, or the call is not the tool's.
//
//   node sdk_clients.cjs --base-url http://127.0.0.1:PORT/v1 --prompt P --max-tokens N [--deps DIR]
'use strict';

const path = require('path');
const { createRequire } = require('module');

const { parseFlags } = require('./flags.cjs');

function parseArgs(argv) {
  return parseFlags(argv, { prompt: '', maxTokens: 16 });
}

async function main() {
  const a = parseArgs(process.argv);
  const req = createRequire(path.join(a.deps, 'package.json'));
  const models = await (await fetch(`${a.baseUrl}/models`)).json();
  const model = models.data[0].id;
  const out = { model };

  const { generateText, streamText } = req('ai');
  const { createOpenAICompatible } = req('@ai-sdk/openai-compatible');
  const provider = createOpenAICompatible({ name: 'tandem', baseURL: a.baseUrl, apiKey: 'unused' });
  const opts = {
    model: provider(model), prompt: a.prompt, maxOutputTokens: a.maxTokens, temperature: 0,
    seed: 0, maxRetries: 0,
  };
  const g = await generateText(opts);
  out.ai = g.text;
  out.ai_finish = g.finishReason;
  out.ai_usage = g.usage;
  let text = '';
  const st = streamText(opts);
  for await (const part of st.textStream) text += part;
  out.ai_stream = text;

  // A tool call: the model must call it (toolChoice required).
  const { tool, jsonSchema } = req('ai');
  const lookAround = tool({
    description: 'What the player sees',
    inputSchema: jsonSchema({
      type: 'object', additionalProperties: false, required: ['direction'],
      properties: { direction: { type: 'string', enum: ['north', 'south'] } },
    }),
  });
  const called = await generateText({ ...opts, tools: { look_around: lookAround },
                                      toolChoice: 'required', maxOutputTokens: 60 });
  out.ai_tool_calls = called.toolCalls.map((c) => ({ name: c.toolName, input: c.input }));

  const { ChatOpenAI } = req('@langchain/openai');
  const llm = new ChatOpenAI({
    model, apiKey: 'unused', configuration: { baseURL: a.baseUrl }, temperature: 0,
    maxTokens: a.maxTokens, maxRetries: 0,
  });
  const m = await llm.invoke(a.prompt);
  out.langchain = m.content;
  text = '';
  for await (const chunk of await llm.stream(a.prompt)) text += chunk.content;
  out.langchain_stream = text;
  const toolLlm = new ChatOpenAI({
    model, apiKey: 'unused', configuration: { baseURL: a.baseUrl }, temperature: 0,
    maxTokens: 60, maxRetries: 0,
  });
  const withTools = toolLlm.bindTools([{
    type: 'function',
    function: {
      name: 'look_around', description: 'What the player sees',
      parameters: {
        type: 'object', additionalProperties: false, required: ['direction'],
        properties: { direction: { type: 'string', enum: ['north', 'south'] } },
      },
    },
  }], { tool_choice: 'required' });
  const lc = await withTools.invoke(a.prompt);
  out.langchain_tool_calls = lc.tool_calls.map((c) => ({ name: c.name, args: c.args }));

  process.stdout.write(JSON.stringify(out) + '\n');
  const called1 = (calls, key) => calls.length === 1 && calls[0].name === 'look_around' &&
      ['north', 'south'].includes(calls[0][key].direction);
  const ok = out.ai === out.ai_stream && out.langchain === out.langchain_stream &&
      out.ai.length > 0 && out.langchain === out.ai &&
      called1(out.ai_tool_calls, 'input') && called1(out.langchain_tool_calls, 'args');
  process.exit(ok ? 0 : 1);
}

main().catch((e) => {
  process.stderr.write(`sdk_clients: ${e.stack || e}\n`);
  process.exit(2);
});
