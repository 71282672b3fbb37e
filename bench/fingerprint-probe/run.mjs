// Runs the fingerprint probe (a wasm32-wasip1 module) in Node.js's V8, the engine Envoy runs
// the filter in: `node run.mjs path/to/fingerprint-probe.wasm [MIN_MS]`. Its stdout and exit
// code are the module's.
import { readFile } from 'node:fs/promises';
import { argv, exit } from 'node:process';
import { WASI } from 'node:wasi';

const [modulePath, ...args] = argv.slice(2);
if (!modulePath) {
  console.error('usage: node run.mjs <fingerprint-probe.wasm> [MIN_MS]');
  exit(2);
}
const wasi = new WASI({ version: 'preview1', args: ['fingerprint-probe', ...args], returnOnExit: true });
const module = await WebAssembly.compile(await readFile(modulePath));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
exit(wasi.start(instance));
