// The pod harness's OpenAI HTTP client: the official `openai` npm package (pinned in
// tests/integration/openai_client/package.json) sends one greedy completion per prompt to the
// router Service and prints [{prompt, text, finish_reason, usage}] as JSON.
//
//   node openai_completions.cjs BASE_URL PROMPTS_FILE MAX_TOKENS OPENAI_DIR
'use strict';

const fs = require('fs');
const path = require('path');

async function main() {
  const [baseURL, promptsFile, maxTokens, openaiDir] = process.argv.slice(2);
  const { default: OpenAI } = require(path.join(openaiDir, 'node_modules', 'openai'));
  const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 2, timeout: 60000 });
  const prompts = fs.readFileSync(promptsFile, 'utf8').split('\n').filter((l) => l.length > 0);
  const out = [];
  for (const prompt of prompts) {
    const r = await client.completions.create({
      model: '', prompt, max_tokens: Number(maxTokens), temperature: 0,
    });
    out.push({ prompt, text: r.choices[0].text, finish_reason: r.choices[0].finish_reason,
               usage: r.usage });
  }
  process.stdout.write(JSON.stringify(out));
}

main().catch((e) => { console.error(e.stack || String(e)); process.exit(1); });
