// Drives tandem's OpenAI-compatible HTTP front door with the official `openai` npm client:
// completions and chat, each non-streaming and streaming (chat with include_usage), plus one
// request the server must refuse (n = 2). Prints one JSON object with the texts, finish
// reasons and usage; exits 1 on any unexpected answer.
//
//   node openai_client.cjs --base-url http://127.0.0.1:PORT/v1 --prompt P [--max-tokens N]
//        [--temperature T] [--seed S] [--model M] [--openai-dir DIR]
//
// The client comes from DIR/node_modules/openai (default: the repository's
// .cache/openai-client, filled by scripts/fetch_openai_client.sh).
'use strict';

const path = require('path');

function parseArgs(argv) {
  const a = {
    baseUrl: '', prompt: '', maxTokens: 16, temperature: 0, seed: 0, model: '',
    openaiDir: path.resolve(__dirname, '../../../.cache/openai-client'),
  };
  for (let i = 2; i < argv.length; i += 2) {
    const v = argv[i + 1];
    switch (argv[i]) {
      case '--base-url': a.baseUrl = v; break;
      case '--prompt': a.prompt = v; break;
      case '--max-tokens': a.maxTokens = Number(v); break;
      case '--temperature': a.temperature = Number(v); break;
      case '--seed': a.seed = Number(v); break;
      case '--model': a.model = v; break;
      case '--openai-dir': a.openaiDir = v; break;
      default: throw new Error(`unknown flag ${argv[i]}`);
    }
  }
  if (!a.baseUrl) throw new Error('--base-url is required');
  return a;
}

async function main() {
  const a = parseArgs(process.argv);
  const mod = require(path.join(a.openaiDir, 'node_modules', 'openai'));
  const OpenAI = mod.OpenAI || mod.default || mod;
  const client = new OpenAI({ baseURL: a.baseUrl, apiKey: 'unused', maxRetries: 0, timeout: 120000 });
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
  for await (const chunk of await client.completions.create({ ...common, prompt: a.prompt, stream: true })) {
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

  try {
    await client.completions.create({ ...common, prompt: a.prompt, n: 2 });
    out.n2_status = 200;
  } catch (e) {
    out.n2_status = e.status;
    out.n2_message = e.error && e.error.message;
  }

  process.stdout.write(JSON.stringify(out) + '\n');
  const ok = out.completion === out.completion_stream && out.chat === out.chat_stream &&
      out.n2_status === 400 && usage !== null && usage.completion_tokens > 0;
  process.exit(ok ? 0 : 1);
}

main().catch((e) => {
  process.stderr.write(`openai_client: ${e.stack || e}\n`);
  process.exit(2);
});
