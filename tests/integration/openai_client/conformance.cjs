// Response conformance of tandem's OpenAI-compatible HTTP front door: JSON Schemas generated
// from the pinned `openai` package's own TypeScript types (ts-json-schema-generator; extra
// fields allowed), and every response and streamed chunk of /v1/models, /v1/completions and
// /v1/chat/completions (plain, streamed, with logprobs, n = 2, tools, json_schema) validated
// against them with ajv. Prints one JSON object (cases checked, failures with ajv's errors);
// exits 1 on any failure.
//
//   node conformance.cjs --base-url http://127.0.0.1:PORT/v1 --prompt P [--deps DIR]
//
// DIR (default: the repository's .cache/openai-client) holds node_modules
// (scripts/fetch_openai_client.sh).
'use strict';

const path = require('path');
const { createRequire } = require('module');

const { parseFlags } = require('./flags.cjs');

function parseArgs(argv) {
  return parseFlags(argv, { prompt: '' });
}

// The openai package's types, as JSON Schemas.
function schemas(req, deps) {
  const tsj = req('ts-json-schema-generator');
  const openai = path.join(deps, 'node_modules', 'openai');
  const types = {
    ChatCompletion: 'resources/chat/completions/completions.d.ts',
    ChatCompletionChunk: 'resources/chat/completions/completions.d.ts',
    Completion: 'resources/completions.d.ts',
    Model: 'resources/models.d.ts',
  };
  const out = {};
  for (const [type, file] of Object.entries(types)) {
    out[type] = tsj.createGenerator({
      path: path.join(openai, file), type, skipTypeCheck: true, additionalProperties: true,
      expose: 'all', topRef: true, jsDoc: 'none',
    }).createSchema(type);
  }
  return out;
}

async function post(url, body) {
  const r = await fetch(url, {
    method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
  });
  const text = await r.text();
  if (r.status !== 200) throw new Error(`${url}: HTTP ${r.status}: ${text}`);
  if (!body.stream) return [JSON.parse(text)];
  const events = [];
  for (const block of text.split('\n\n')) {
    if (!block.startsWith('data: ')) continue;
    const data = block.slice(6);
    if (data === '[DONE]') break;
    events.push(JSON.parse(data));
  }
  return events;
}

async function main() {
  const a = parseArgs(process.argv);
  const req = createRequire(path.join(a.deps, 'package.json'));
  const Ajv = req('ajv');
  const ajv = new Ajv({ allErrors: true, strict: false });
  const s = schemas(req, a.deps);
  // The package types streamed completions with the non-streaming Completion, whose
  // finish_reason is never null; streams (OpenAI's own too) send null until the last chunk.
  // CompletionChunk is Completion with that one field nullable.
  const chunk = JSON.parse(JSON.stringify(s.Completion));
  const choice = chunk.definitions.CompletionChoice;
  choice.properties.finish_reason = { anyOf: [choice.properties.finish_reason, { type: 'null' }] };
  s.CompletionChunk = chunk;
  const validate = {};
  for (const [type, schema] of Object.entries(s)) validate[type] = ajv.compile(schema);

  const models = await (await fetch(`${a.baseUrl}/models`)).json();
  const model = models.data[0].id;
  const base = { model, max_tokens: 12, temperature: 0, seed: 3 };
  const messages = [{ role: 'user', content: a.prompt }];
  const schema = {
    type: 'object', additionalProperties: false, required: ['name', 'mood'],
    properties: { name: { type: 'string', maxLength: 10 }, mood: { enum: ['calm', 'angry'] } },
  };
  const tools = [{ type: 'function', function: { name: 'wave', parameters: schema } }];
  const cases = [
    ['completion', 'completions', { prompt: a.prompt }],
    ['completion stream', 'completions', { prompt: a.prompt, stream: true,
                                           stream_options: { include_usage: true } }],
    ['completion logprobs', 'completions', { prompt: a.prompt, logprobs: 2 }],
    ['completion logprobs stream', 'completions', { prompt: a.prompt, logprobs: 2, stream: true }],
    ['completion n=2', 'completions', { prompt: a.prompt, n: 2, temperature: 0.9 }],
    ['completion n=2 stream', 'completions', { prompt: a.prompt, n: 2, temperature: 0.9,
                                               stream: true }],
    ['completion echo', 'completions', { prompt: a.prompt, echo: true }],
    ['chat', 'chat/completions', { messages }],
    ['chat stream', 'chat/completions', { messages, stream: true,
                                          stream_options: { include_usage: true } }],
    ['chat logprobs', 'chat/completions', { messages, logprobs: true, top_logprobs: 3 }],
    ['chat logprobs stream', 'chat/completions', { messages, logprobs: true, top_logprobs: 3,
                                                   stream: true }],
    ['chat n=2', 'chat/completions', { messages, n: 2, temperature: 0.9 }],
    ['chat n=2 stream', 'chat/completions', { messages, n: 2, temperature: 0.9, stream: true }],
    ['chat tools', 'chat/completions',
      { messages, tools, tool_choice: 'required', max_tokens: 60 }],
    ['chat tools stream', 'chat/completions', { messages, tools, tool_choice: 'required',
                                               max_tokens: 60, stream: true }],
    ['chat json_schema', 'chat/completions', {
      messages, max_tokens: 60,
      response_format: { type: 'json_schema', json_schema: { name: 'npc', strict: true, schema } },
    }],
  ];
  const out = { checked: 0, failures: [] };
  const check = (name, type, obj) => {
    out.checked++;
    if (!validate[type](obj)) {
      out.failures.push({ case: name, type, errors: validate[type].errors, object: obj });
    }
  };
  for (const m of models.data) check('models', 'Model', m);
  for (const [name, endpoint, body] of cases) {
    const objs = await post(`${a.baseUrl}/${endpoint}`, { ...base, ...body });
    const chat = endpoint.startsWith('chat');
    const type = chat ? (body.stream ? 'ChatCompletionChunk' : 'ChatCompletion')
                      : (body.stream ? 'CompletionChunk' : 'Completion');
    if (objs.length === 0) out.failures.push({ case: name, error: 'no response objects' });
    for (const o of objs) check(name, type, o);
  }
  process.stdout.write(JSON.stringify(out) + '\n');
  process.exit(out.failures.length === 0 && out.checked > cases.length ? 0 : 1);
}

main().catch((e) => {
  process.stderr.write(`conformance: ${e.stack || e}\n`);
  process.exit(2);
});
