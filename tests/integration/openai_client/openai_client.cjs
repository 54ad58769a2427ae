// Drives tandem's OpenAI-compatible HTTP front door with the official `openai` npm client:
// completions and chat, each non-streaming and streaming (chat with include_usage), with
// log-probabilities, two choices (n = 2), echo, structured output (json_schema, json_object)
// and a tool call round trip. Prints one JSON object with the texts,
// finish reasons, usage and log-probabilities; exits 1 on any unexpected answer.
//
//   node openai_client.cjs --base-url http://127.0.0.1:PORT/v1 --prompt P [--max-tokens N]
//        [--temperature T] [--seed S] [--model M] [--deps DIR]
//
// The client comes from DIR/node_modules/openai (default: the repository's
// .cache/openai-client, filled by scripts/fetch_openai_client.sh).
'use strict';

const path = require('path');

const { parseFlags } = require('./flags.cjs');

function parseArgs(argv) {
  return parseFlags(argv, { prompt: '', maxTokens: 16, temperature: 0, seed: 0, model: '' });
}

async function main() {
  const a = parseArgs(process.argv);
  const mod = require(path.join(a.deps, 'node_modules', 'openai'));
  const OpenAI = mod.OpenAI || mod.default || mod;
  const client = new OpenAI({
    baseURL: a.baseUrl, apiKey: 'unused', maxRetries: 0, timeout: 120000,
  });
  const models = await client.models.list();
  const model = a.model || models.data[0].id;
  const common = { model, max_tokens: a.maxTokens, temperature: a.temperature, seed: a.seed };
  const out = { model };

  const c = await client.completions.create({ ...common, prompt: a.prompt });
  out.completion = c.choices[0].text;
  out.completion_finish = c.choices[0].finish_reason;
  out.completion_usage = c.usage;

  let text = '';
  let finish = null;
  const completionStream =
      await client.completions.create({ ...common, prompt: a.prompt, stream: true });
  for await (const chunk of completionStream) {
    text += chunk.choices[0].text;
    finish = chunk.choices[0].finish_reason || finish;
  }
  out.completion_stream = text;
  out.completion_stream_finish = finish;

  const messages = [{ role: 'user', content: a.prompt }];
  const ch = await client.chat.completions.create({ ...common, messages });
  out.chat = ch.choices[0].message.content;
  out.chat_finish = ch.choices[0].finish_reason;

  text = '';
  finish = null;
  let usage = null;
  const stream = await client.chat.completions.create({
    ...common, messages, stream: true, stream_options: { include_usage: true },
  });
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    if (chunk.choices.length === 0) continue;
    text += chunk.choices[0].delta.content || '';
    finish = chunk.choices[0].finish_reason || finish;
  }
  out.chat_stream = text;
  out.chat_stream_finish = finish;
  out.chat_stream_usage = usage;

  // Log-probabilities: greedy, so each token is its own most likely alternative.
  const lp = await client.chat.completions.create({
    ...common, messages, logprobs: true, top_logprobs: 3,
  });
  const content = lp.choices[0].logprobs.content;
  out.chat_logprobs = content.map((t) => ({
    token: t.token, logprob: t.logprob, bytes: t.bytes.length,
    top: t.top_logprobs.map((x) => [x.token, x.logprob]),
  }));
  out.chat_logprobs_text = lp.choices[0].message.content;
  let streamed = 0;
  for await (const chunk of await client.chat.completions.create({
    ...common, messages, logprobs: true, top_logprobs: 1, stream: true,
  })) {
    if (chunk.choices.length > 0 && chunk.choices[0].logprobs) {
      streamed += chunk.choices[0].logprobs.content.length;
    }
  }
  out.chat_stream_logprobs = streamed;
  const clp = await client.completions.create({ ...common, prompt: a.prompt, logprobs: 2 });
  out.completion_logprobs = clp.choices[0].logprobs;

  // Two choices, sampled with one seed: each its own seed, both in one response; streamed,
  // every chunk names its choice.
  const n2 = await client.completions.create({
    ...common, prompt: a.prompt, n: 2, temperature: 0.9, seed: 11,
  });
  out.n2 = n2.choices.map((c) => ({ index: c.index, text: c.text, finish: c.finish_reason }));
  out.n2_usage = n2.usage;
  const texts = ['', ''];
  let n2usage = null;
  for await (const chunk of await client.chat.completions.create({
    ...common, messages, n: 2, temperature: 0.9, seed: 11, stream: true,
    stream_options: { include_usage: true },
  })) {
    if (chunk.usage) n2usage = chunk.usage;
    for (const c of chunk.choices) texts[c.index] += c.delta.content || '';
  }
  out.n2_chat_stream = texts;
  out.n2_chat_stream_usage = n2usage;

  const echo = await client.completions.create({ ...common, prompt: a.prompt, echo: true });
  out.echo = echo.choices[0].text;

  // Structured output: four sampled answers under a strict schema, and any JSON object.
  const schema = {
    type: 'object',
    properties: {
      name: { type: 'string', minLength: 1, maxLength: 16 },
      mood: { enum: ['happy', 'sad', 'scared'] },
      age: { type: 'integer' },
      friends: { type: 'array', items: { type: 'string', maxLength: 8 }, maxItems: 3 },
    },
    required: ['name', 'mood', 'age', 'friends'],
    additionalProperties: false,
  };
  const structured = await client.chat.completions.create({
    ...common, messages, max_tokens: 200, temperature: 1.0, n: 4, seed: 5,
    response_format: { type: 'json_schema', json_schema: { name: 'npc', strict: true, schema } },
  });
  out.json_schema = structured.choices.map((c) => c.message.content);
  out.json_schema_finish = structured.choices.map((c) => c.finish_reason);
  const obj = await client.completions.create({
    ...common, prompt: a.prompt, max_tokens: 200, temperature: 1.0,
    response_format: { type: 'json_object' },
  });
  out.json_object = obj.choices[0].text;
  out.json_object_finish = obj.choices[0].finish_reason;

  // A tool call round trip: tools -> tool_calls -> a tool message -> an answer.
  const tools = [{
    type: 'function',
    function: {
      name: 'look_around', description: 'What the player sees',
      parameters: {
        type: 'object', additionalProperties: false, required: ['direction'],
        properties: { direction: { enum: ['north', 'south', 'east', 'west'] } },
      },
    },
  }];
  const call = await client.chat.completions.create({
    ...common, messages, tools, tool_choice: 'required', max_tokens: 60,
  });
  const tc = call.choices[0].message.tool_calls;
  out.tool_finish = call.choices[0].finish_reason;
  out.tool_calls = tc;
  if (tc && tc.length > 0) {
    const answer = await client.chat.completions.create({
      ...common, tools, max_tokens: 16,
      messages: [...messages, call.choices[0].message,
                 { role: 'tool', tool_call_id: tc[0].id, content: 'A dark forest.' }],
    });
    out.tool_answer = answer.choices[0].message.content;
    out.tool_answer_finish = answer.choices[0].finish_reason;
  }
  let streamedCall = null;
  for await (const chunk of await client.chat.completions.create({
    ...common, messages, tools, max_tokens: 60, stream: true,
    tool_choice: { type: 'function', function: { name: 'look_around' } },
  })) {
    const d = chunk.choices.length > 0 ? chunk.choices[0].delta : null;
    if (d && d.tool_calls) streamedCall = d.tool_calls[0];
    if (chunk.choices.length > 0 && chunk.choices[0].finish_reason) {
      out.tool_stream_finish = chunk.choices[0].finish_reason;
    }
  }
  out.tool_stream_call = streamedCall;

  process.stdout.write(JSON.stringify(out) + '\n');
  const ok = out.completion === out.completion_stream && out.chat === out.chat_stream &&
      usage !== null && usage.completion_tokens > 0;
  process.exit(ok ? 0 : 1);
}

main().catch((e) => {
  process.stderr.write(`openai_client: ${e.stack || e}\n`);
  process.exit(2);
});
