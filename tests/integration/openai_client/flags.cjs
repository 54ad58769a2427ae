// Command-line flags for the client scripts here: `--name value` pairs into an object whose
// defaults name every flag allowed (--base-url sets baseUrl; numbers stay numbers). The
// dependencies default to the repository's .cache/openai-client (scripts/fetch_openai_client.sh)
// and --base-url is required.
'use strict';

const path = require('path');

const kDeps = path.resolve(__dirname, '../../../.cache/openai-client');

function parseFlags(argv, defaults) {
  const a = { baseUrl: '', deps: kDeps, ...defaults };
  for (let i = 2; i < argv.length; i += 2) {
    const key = argv[i].replace(/^--/, '').replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    if (!argv[i].startsWith('--') || !(key in a)) throw new Error(`unknown flag ${argv[i]}`);
    a[key] = typeof a[key] === 'number' ? Number(argv[i + 1]) : argv[i + 1];
  }
  if (!a.baseUrl) throw new Error('--base-url is required');
  return a;
}

module.exports = { parseFlags };
