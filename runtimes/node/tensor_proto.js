'use strict';
// Minimal ONNX TensorProto reader/writer (the backend-test .pb format): dims (field 1),
// data_type (2), name (8), raw_data (9). Enough for numeric tensors written by
// onnx.numpy_helper.from_array, which always uses raw_data.

const TYPES = {
  1: { name: 'float32', array: Float32Array },
  3: { name: 'int8', array: Int8Array },  // an int8 KV cache (--kv-dtype int8)
  6: { name: 'int32', array: Int32Array },
  7: { name: 'int64', array: BigInt64Array },
  9: { name: 'bool', array: Uint8Array },
  10: { name: 'float16', array: Uint16Array },
  11: { name: 'float64', array: Float64Array },
};
const TYPE_CODES = Object.fromEntries(Object.entries(TYPES).map(([code, t]) => [t.name, Number(code)]));

function readVarint(buf, pos) {
  let result = 0n;
  let shift = 0n;
  for (;;) {
    if (pos >= buf.length) throw new Error('truncated varint');
    const byte = buf[pos++];
    result |= BigInt(byte & 0x7f) << shift;
    if ((byte & 0x80) === 0) return [result, pos];
    shift += 7n;
  }
}

// The fields of a protobuf message as [field number, wire type, value]: a BigInt for varints,
// the bytes for length-delimited fields; fixed-width fields are skipped.
function* fieldsOf(buf) {
  let pos = 0;
  while (pos < buf.length) {
    let key;
    [key, pos] = readVarint(buf, pos);
    const field = Number(key >> 3n);
    const wire = Number(key & 7n);
    if (wire === 0) {
      let value;
      [value, pos] = readVarint(buf, pos);
      yield [field, wire, value];
    } else if (wire === 2) {
      let len;
      [len, pos] = readVarint(buf, pos);
      const end = pos + Number(len);
      if (end > buf.length) throw new Error('truncated field');
      yield [field, wire, buf.subarray(pos, end)];
      pos = end;
    } else if (wire === 5) pos += 4;
    else if (wire === 1) pos += 8;
    else throw new Error(`unsupported wire type ${wire}`);
  }
}

function decodeTensor(buf) {
  const dims = [];
  let dataType = 0;
  let name = '';
  let raw = null;
  for (const [field, wire, value] of fieldsOf(buf)) {
    if (wire === 0) {
      if (field === 1) dims.push(Number(BigInt.asIntN(64, value)));
      else if (field === 2) dataType = Number(value);
    } else if (field === 1) { // packed dims
      let p = 0;
      while (p < value.length) { let v; [v, p] = readVarint(value, p); dims.push(Number(BigInt.asIntN(64, v))); }
    } else if (field === 8) name = value.toString('utf8');
    else if (field === 9) raw = value;
    else if (field === 4 || field === 5 || field === 7 || field === 10) throw new Error('only raw_data tensors are supported');
  }
  const type = TYPES[dataType];
  if (!type) throw new Error(`unsupported data_type ${dataType}`);
  const count = dims.reduce((a, b) => a * b, 1);
  const copy = new Uint8Array(raw ? raw.length : 0);
  if (raw) copy.set(raw);
  const data = new type.array(copy.buffer, 0, copy.byteLength / type.array.BYTES_PER_ELEMENT);
  if (data.length !== count) throw new Error(`raw_data holds ${data.length} values, dims need ${count}`);
  return { name, type: type.name, dims, data };
}

function encodeVarint(value) {
  let v = BigInt.asUintN(64, BigInt(value));
  const out = [];
  do {
    let byte = Number(v & 0x7fn);
    v >>= 7n;
    if (v) byte |= 0x80;
    out.push(byte);
  } while (v);
  return Buffer.from(out);
}

function encodeTensor(name, type, dims, data) {
  const code = TYPE_CODES[type];
  if (!code) throw new Error(`cannot encode type ${type}`);
  const parts = [];
  for (const d of dims) parts.push(Buffer.from([0x08]), encodeVarint(d));
  parts.push(Buffer.from([0x10]), encodeVarint(code));
  const nameBytes = Buffer.from(name, 'utf8');
  parts.push(Buffer.from([0x42]), encodeVarint(nameBytes.length), nameBytes);
  const raw = Buffer.from(data.buffer, data.byteOffset, data.byteLength);
  parts.push(Buffer.from([0x4a]), encodeVarint(raw.length), raw);
  return Buffer.concat(parts);
}

// ModelProto.metadata_props (field 14): StringStringEntryProto {key: 1, value: 2}.
function readModelMetadata(buf) {
  const meta = {};
  for (const [field, wire, bytes] of fieldsOf(buf)) {
    if (field !== 14 || wire !== 2) continue;
    const entry = {};
    for (const [f, w, b] of fieldsOf(bytes)) if (w === 2) entry[f] = b.toString('utf8');
    if (entry[1] !== undefined) meta[entry[1]] = entry[2] || '';
  }
  return meta;
}

module.exports = { decodeTensor, encodeTensor, readModelMetadata };
