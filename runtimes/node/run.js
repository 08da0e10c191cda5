#!/usr/bin/env node
'use strict';
// Run an ONNX model with onnxruntime-node (CPU) on ONNX backend-test tensors.
//   node runtimes/node/run.js model.onnx inputs/ outputs/
// inputs/: input_N.pb files, or test_data_set_N/ folders of them; outputs mirror the layout.
// Inputs are checked against the model's declared names, dtypes and ranks before running.
const fs = require('fs');
const path = require('path');
const { decodeTensor, encodeTensor, readModelMetadata } = require('./tensor_proto');

class RunnerError extends Error {}

function numbered(dir, prefix) {
  return fs.readdirSync(dir)
    .filter((f) => new RegExp(`^${prefix}_\\d+(\\.pb)?$`).test(f))
    .sort((a, b) => parseInt(a.split('_').pop(), 10) - parseInt(b.split('_').pop(), 10));
}

function dataSets(inputs) {
  if (!fs.existsSync(inputs)) throw new RunnerError(`inputs ${inputs} do not exist`);
  if (inputs.endsWith('.npz')) throw new RunnerError(`inputs ${inputs}: the node runner reads ONNX tensor folders (input_N.pb), not .npz`);
  if (!fs.statSync(inputs).isDirectory()) throw new RunnerError(`inputs ${inputs}: expected a folder of input_N.pb files`);
  const sets = numbered(inputs, 'test_data_set').filter((d) => fs.statSync(path.join(inputs, d)).isDirectory());
  if (sets.length) return sets.map((d) => [d, path.join(inputs, d), true]);
  if (numbered(inputs, 'input').length) return [[path.basename(inputs), inputs, false]];
  throw new RunnerError(`inputs ${inputs}: no input_N.pb files and no test_data_set_N folders`);
}

// The vocabulary size of a posbias language model (its metadata), else null: runtimes wrap
// or ignore out-of-range ids where PyTorch refuses them.
function tokenLimit(modelMeta) {
  // an imported model (BLOOM, T5, ...) records its vocabulary as posbias.vocab_size
  if (modelMeta['posbias.vocab_size'] !== undefined) {
    const limit = Number(modelMeta['posbias.vocab_size']);
    return Number.isInteger(limit) && limit > 0 ? limit : null;
  }
  if ((modelMeta['posbias.arch'] || 'lm') !== 'lm' || !modelMeta['posbias.config']) return null;
  try {
    const limit = JSON.parse(modelMeta['posbias.config']).vocab_size;
    return Number.isInteger(limit) ? limit : null;
  } catch (err) {
    return null;
  }
}

function checkFeeds(tensors, metadata, idLimit) {
  const expected = metadata.map((m) => m.name);
  const given = tensors.map((t) => t.name);
  const missing = expected.filter((n) => !given.includes(n));
  const unexpected = given.filter((n) => !expected.includes(n));
  if (missing.length || unexpected.length) {
    throw new RunnerError(`input names do not match the model (missing [${missing}]; unexpected [${unexpected}]); it expects [${expected}]`);
  }
  const symbols = {};
  for (const m of metadata) {
    const t = tensors.find((x) => x.name === m.name);
    if (t.type !== m.type) throw new RunnerError(`input '${m.name}': expected dtype ${m.type}, got ${t.type}`);
    if (t.dims.length !== m.shape.length) throw new RunnerError(`input '${m.name}': expected rank ${m.shape.length}, got shape [${t.dims}]`);
    m.shape.forEach((want, axis) => {
      const got = t.dims[axis];
      if (typeof want === 'number' && want >= 0 && want !== got) throw new RunnerError(`input '${m.name}': axis ${axis} must be ${want}, got ${got}`);
      if (typeof want === 'string' && want) {
        if (symbols[want] && symbols[want][1] !== got) throw new RunnerError(`inputs '${symbols[want][0]}' and '${m.name}' disagree on axis '${want}': ${symbols[want][1]} vs ${got}`);
        symbols[want] = symbols[want] || [m.name, got];
      }
    });
    // a cached decoder's cache may hold no step yet (a prefill): only its past axis may be 0 (named
    // past...; a merged seq2seq decoder's cross cache: encoder_sequence_length_out, empty before the
    // first step as transformers.js feeds it); the rule of runtimes/common/cache.py is_past_axis
    const pastAxis = (name) => typeof name === 'string' && (name.includes('past') || name === 'encoder_sequence_length_out');
    const emptyCache = t.dims.some((d) => d === 0) && t.dims.every((d, axis) => d !== 0 || pastAxis(m.shape[axis]));
    if (t.data.length === 0 && !emptyCache) throw new RunnerError(`input '${m.name}' is empty (shape [${t.dims}])`);
    if (m.name === 'input_ids' && idLimit !== null) {
      for (const v of t.data) {
        if (v < 0 || v >= idLimit) throw new RunnerError(`input 'input_ids': token id ${v} is outside the vocabulary [0, ${idLimit})`);
      }
    }
  }
}

async function main(argv) {
  // --fresh-sessions: a new session for every data set (default: one session runs them all)
  const fresh = argv.includes('--fresh-sessions');
  argv = argv.filter((a) => a !== '--fresh-sessions');
  if (argv.length !== 3 || argv.includes('--help')) {
    console.log('usage: node run.js model.onnx inputs/ outputs/ [--fresh-sessions]');
    return argv.includes('--help') ? 0 : 2;
  }
  const [modelPath, inputs, outputs] = argv;
  let ort;
  try {
    ort = require('onnxruntime-node');
  } catch (err) {
    throw new RunnerError('onnxruntime-node is not installed (npm install --ignore-scripts in runtimes/node)');
  }
  if (!fs.existsSync(modelPath) || !fs.statSync(modelPath).isFile()) throw new RunnerError(`model ${modelPath} does not exist`);
  ort.env.logLevel = 'fatal';  // errors reach the user as our one line, not as the runtime's native log
  const open = async () => {
    try {
      return await ort.InferenceSession.create(modelPath, { executionProviders: ['cpu'], logSeverityLevel: 4 });
    } catch (err) {
      throw new RunnerError(`cannot load model ${modelPath}: ${String(err.message || err).split('\n')[0]}`);
    }
  };
  let session = await open();
  let idLimit = null;
  try {
    idLimit = tokenLimit(readModelMetadata(fs.readFileSync(modelPath)));
  } catch (err) {
    idLimit = null; // the session above loaded it; a metadata we cannot parse checks nothing
  }
  const sets = dataSets(inputs);
  const inputPaths = [modelPath, inputs, ...sets.map(([, dir]) => dir)];
  for (const target of sets.map(([name, , grouped]) => (grouped ? path.join(outputs, name) : outputs))) {
    const clash = inputPaths.find((p) => sameFile(p, target));
    if (clash) throw new RunnerError(`refusing to write ${target}: it is also an input (${path.basename(clash)})`);
  }
  const results = [];  // every set runs before any output is written: a failed run creates nothing
  for (const [index, [name, dir, grouped]] of sets.entries()) {
    if (fresh && index) session = await open();
    const tensors = numbered(dir, 'input').map((f, i) => {
      try {
        const t = decodeTensor(fs.readFileSync(path.join(dir, f)));
        if (!t.name) t.name = session.inputNames[i];
        return t;
      } catch (err) {
        throw new RunnerError(`cannot read tensor ${path.join(dir, f)}: ${err.message}`);
      }
    });
    checkFeeds(tensors, session.inputMetadata, idLimit);
    const feeds = {};
    for (const t of tensors) feeds[t.name] = new ort.Tensor(t.type, t.data, t.dims);
    const start = process.hrtime.bigint();
    let result;
    try {
      result = await session.run(feeds);
    } catch (err) {
      throw new RunnerError(`onnxruntime-node failed: ${String(err.message || err).split('\n')[0]}`);
    }
    const ms = Number(process.hrtime.bigint() - start) / 1e6;
    results.push([grouped ? path.join(outputs, name) : outputs, result]);
    console.log(`node: ${name} ran in ${ms.toFixed(1)} ms`);
  }
  const files = [];  // every tensor of every set, then written all or none
  const made = [];
  for (const [outDir, result] of results) {
    if (!fs.existsSync(outDir)) made.push(outDir);
    makeFolder(outDir);
    session.outputNames.forEach((outName, i) => {
      const t = result[outName];
      files.push([path.join(outDir, `output_${i}.pb`), encodeTensor(outName, t.type, t.dims.map(Number), t.data)]);
    });
  }
  try {
    writeAll(files);
  } catch (err) {
    for (const dir of made.reverse()) {
      try {
        fs.rmdirSync(dir);  // a folder this run made, empty again
      } catch (e) { /* not empty: not only ours */ }
    }
    throw err;
  }
  return 0;
}

function sameFile(a, b) {
  if (path.resolve(a) === path.resolve(b)) return true;
  try {
    const [x, y] = [fs.statSync(a), fs.statSync(b)];
    return x.ino === y.ino && x.dev === y.dev;
  } catch (err) {
    return false;
  }
}

function makeFolder(dir) {
  for (let part = path.resolve(dir); ; part = path.dirname(part)) {
    if (fs.existsSync(part) && !fs.statSync(part).isDirectory()) throw new RunnerError(`cannot write into ${dir}: ${part} is a file`);
    if (path.dirname(part) === part) break;
  }
  try {
    fs.mkdirSync(dir, { recursive: true });
  } catch (err) {
    throw new RunnerError(`cannot make the output folder ${dir}: ${err.code || err.message}`);
  }
}

// As runtimes/common/atomic.py: a temporary beside the target named after this process,
// flushed, renamed; removed on any failure (and on SIGTERM / Ctrl-C, see below).
const temporaries = new Set();
// Several files all or none: each written to its temporary and flushed, then all renamed; on
// any failure every temporary goes and no target changed (a full disk at output_1 leaves no
// output_0).
function writeAll(files) {
  const pending = [];
  try {
    for (const [target, bytes] of files) {
      const tmp = path.join(path.dirname(target), `.${path.basename(target)}.${process.pid}.${Date.now()}.posbias-tmp`);
      temporaries.add(tmp);
      pending.push([tmp, target]);
      try {
        const fd = fs.openSync(tmp, 'w');
        try {
          // writeSync may write less than asked (a disk that fills): go on until it says why
          for (let done = 0; done < bytes.length;) done += fs.writeSync(fd, bytes, done, bytes.length - done);
          fs.fsyncSync(fd);
        } finally {
          fs.closeSync(fd);
        }
      } catch (err) {
        throw new RunnerError(`cannot write ${target}: ${err.code || err.message}`);
      }
    }
    for (const [tmp, target] of pending) fs.renameSync(tmp, target);
  } finally {
    for (const [tmp] of pending) {
      fs.rmSync(tmp, { force: true });
      temporaries.delete(tmp);
    }
  }
}

for (const [signal, code, word] of [['SIGTERM', 143, 'terminated'], ['SIGINT', 130, 'interrupted']]) {
  process.on(signal, () => {
    for (const tmp of temporaries) fs.rmSync(tmp, { force: true });
    process.stderr.write(`node: ${word}\n`);
    process.exit(code);
  });
}

main(process.argv.slice(2)).then((code) => process.exit(code), (err) => {
  const message = err instanceof RunnerError ? err.message : String(err && err.message || err).split('\n')[0];
  process.stderr.write(`node: error: ${message}\n`);
  process.exit(2);
});
