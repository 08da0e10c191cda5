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
    // a cached decoder's cache may hold no step yet (a prefill): only its past axis may be 0
    const emptyCache = t.dims.some((d) => d === 0) &&
      t.dims.every((d, axis) => d !== 0 || (typeof m.shape[axis] === 'string' && m.shape[axis].includes('past')));
    if (t.data.length === 0 && !emptyCache) throw new RunnerError(`input '${m.name}' is empty (shape [${t.dims}])`);
    if (m.name === 'input_ids' && idLimit !== null) {
      for (const v of t.data) {
        if (v < 0 || v >= idLimit) throw new RunnerError(`input 'input_ids': token id ${v} is outside the vocabulary [0, ${idLimit})`);
      }
    }
  }
}

async function main(argv) {
  if (argv.length !== 3 || argv.includes('--help')) {
    console.log('usage: node run.js model.onnx inputs/ outputs/');
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
  let session;
  try {
    session = await ort.InferenceSession.create(modelPath, { executionProviders: ['cpu'], logSeverityLevel: 3 });
  } catch (err) {
    throw new RunnerError(`cannot load model ${modelPath}: ${String(err.message || err).split('\n')[0]}`);
  }
  let idLimit = null;
  try {
    idLimit = tokenLimit(readModelMetadata(fs.readFileSync(modelPath)));
  } catch (err) {
    idLimit = null; // the session above loaded it; a metadata we cannot parse checks nothing
  }
  for (const [name, dir, grouped] of dataSets(inputs)) {
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
    const outDir = grouped ? path.join(outputs, name) : outputs;
    fs.mkdirSync(outDir, { recursive: true });
    session.outputNames.forEach((outName, i) => {
      const t = result[outName];
      const target = path.join(outDir, `output_${i}.pb`);
      fs.writeFileSync(`${target}.tmp`, encodeTensor(outName, t.type, t.dims.map(Number), t.data));
      fs.renameSync(`${target}.tmp`, target);
    });
    console.log(`node: ${name} ran in ${ms.toFixed(1)} ms`);
  }
  return 0;
}

main(process.argv.slice(2)).then((code) => process.exit(code), (err) => {
  const message = err instanceof RunnerError ? err.message : String(err && err.message || err).split('\n')[0];
  process.stderr.write(`node: error: ${message}\n`);
  process.exit(2);
});
