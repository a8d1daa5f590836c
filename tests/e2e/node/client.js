// stencild from another language: a Node.js client built the way a user
// would build one, @grpc/grpc-js with the repository's protos loaded at run
// time by @grpc/proto-loader under protobuf's JSON mapping (the names and
// forms of the README's grpcurl payloads). tests/e2e/test_node_client.py
// starts `stencild serve` and runs this with
//   STENCILD_ADDR        host:port of the server
//   STENCILD_PROTO_PATH  include directories, joined by the path delimiter
//   NODE_PATH            where npm put @grpc/grpc-js and @grpc/proto-loader
// It prints one line per check and exits 1 if any failed.
'use strict';

const assert = require('assert/strict');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');

const ADDR = process.env.STENCILD_ADDR;
const INCLUDE = process.env.STENCILD_PROTO_PATH.split(path.delimiter);
// lowerCamelCase names, enums by name, 64-bit integers as strings (a JS
// number loses digits past 2^53), and each oneof's case named.
const OPTIONS = { keepCase: false, longs: String, enums: String, defaults: false, oneofs: true, includeDirs: INCLUDE };

const definition = protoLoader.loadSync(
  ['stencil/v1/generate.proto', 'stencil/v1/embed.proto', 'stencil/v1/speech.proto', 'vllm_engine.proto',
    'grpc/health/v1/health.proto'], OPTIONS);
const api = grpc.loadPackageDefinition(definition);

function connect(channelOptions = {}) {
  const credentials = grpc.credentials.createInsecure();
  const generation = new api.stencil.v1.Generation(ADDR, credentials, channelOptions);
  // One channel for every service, as a client would share it.
  const shared = { ...channelOptions, channelOverride: generation.getChannel() };
  return {
    generation,
    embeddings: new api.stencil.v1.Embeddings(ADDR, credentials, shared),
    speech: new api.stencil.v1.Speech(ADDR, credentials, shared),
    vllm: new api.vllm.grpc.engine.VllmEngine(ADDR, credentials, shared),
    health: new api.grpc.health.v1.Health(ADDR, credentials, shared),
  };
}

const within = (seconds = 60) => ({ deadline: Date.now() + seconds * 1000 });

// A unary call as a promise of {err, response, headers}.
function unary(client, method, request, options = within()) {
  return new Promise((resolve) => {
    let headers = null;
    const call = client[method](request, new grpc.Metadata(), options,
      (err, response) => resolve({ err, response, headers }));
    call.on('metadata', (m) => { headers = m.getMap(); });
  });
}

// A server stream read to its end: {err, messages, headers}; `onMessage` sees
// each message with the call (to cancel it, or to act once it has started).
function serverStream(client, method, request, options = within(), onMessage = null) {
  return new Promise((resolve) => {
    const messages = [];
    let headers = null;
    const call = client[method](request, new grpc.Metadata(), options);
    call.on('metadata', (m) => { headers = m.getMap(); });
    call.on('data', (message) => { messages.push(message); if (onMessage) onMessage(message, call); });
    call.on('error', (err) => resolve({ err, messages, headers }));
    call.on('end', () => setImmediate(() => resolve({ err: null, messages, headers })));
  });
}

const chunks = (r) => r.messages.filter((m) => m.response === 'chunk').map((m) => m.chunk);
const complete = (r) => r.messages[r.messages.length - 1].complete;
const tokenIds = (r) => chunks(r).flatMap((c) => c.tokenIds || []);
const text = (r) => chunks(r).map((c) => c.text || '').join('');

// google.rpc.Status from an error's grpc-status-details-bin trailer, each
// detail decoded by its type: {type name: detail}.
const statusTypes = protobuf.loadSync(
  ['google/rpc/status.proto', 'google/rpc/error_details.proto'].map((f) => findProto(f)));
function findProto(file) {
  const dir = INCLUDE.find((d) => require('fs').existsSync(path.join(d, file)));
  assert.ok(dir, `${file} is on none of ${INCLUDE}`);
  return path.join(dir, file);
}
function errorDetails(err) {
  const [bin] = err.metadata.get('grpc-status-details-bin');
  assert.ok(bin, 'the error carries no grpc-status-details-bin');
  const status = statusTypes.lookupType('google.rpc.Status').decode(bin);
  const details = {};
  for (const any of status.details) {
    // protobufjs's own copy of any.proto keeps the field's proto name.
    const type = statusTypes.lookupType((any.typeUrl || any.type_url).split('/').pop());
    details[type.fullName.slice(1)] = type.toObject(type.decode(any.value), { enums: String });
  }
  return details;
}

const README_SCHEMA = {
  type: 'object', properties: { age: { type: 'integer', minimum: 0, maximum: 150 } },
  required: ['age'], additionalProperties: false,
};
const WEATHER = {
  type: 'object', properties: { city: { type: 'string', maxLength: 20 } },
  required: ['city'], additionalProperties: false,
};
const LONG = { maxNewTokens: 1000, ignoreEos: true };

const checks = {
  async 'health: SERVING, by Check and by Watch'(c) {
    assert.equal((await unary(c.health, 'Check', {})).response.status, 'SERVING');
    const watch = c.health.Watch({ service: 'stencil.v1.Generation' });
    const first = await new Promise((resolve, reject) => { watch.on('data', (m) => resolve(m.status)); watch.on('error', reject); });
    watch.cancel();
    assert.equal(first, 'SERVING');
  },

  async 'Generate: chunks then one complete; the x-request-id header; reproducible greedy text'(c) {
    const request = { text: 'Once upon a time', sampling: { temperature: 0 }, stopping: { maxNewTokens: 16 } };
    const r = await serverStream(c.generation, 'Generate', request);
    assert.ifError(r.err);
    assert.equal(chunks(r).length, r.messages.length - 1);
    assert.equal(complete(r).finishReason, 'LENGTH');
    assert.equal(complete(r).usage.completionTokens, 16);
    assert.equal(tokenIds(r).length, 16);
    assert.equal(r.headers['x-request-id'], r.messages[0].requestId);
    const detok = await unary(c.generation, 'Detokenize', { tokenIds: tokenIds(r) });
    assert.equal(detok.response.text, text(r));
    assert.deepEqual(tokenIds(await serverStream(c.generation, 'Generate', request)), tokenIds(r));
  },

  async 'Generate with a JSON schema: the answer parses and validates'(c) {
    const r = await serverStream(c.generation, 'Generate', {
      text: 'A user:', stopping: { maxNewTokens: 80 }, constraint: { jsonSchema: JSON.stringify(README_SCHEMA) },
    });
    assert.ifError(r.err);
    assert.equal(complete(r).finishReason, 'EOS');
    assert.equal(complete(r).schemaValidation.result, 'VALID');
    const { age } = JSON.parse(text(r));
    assert.ok(Number.isInteger(age) && age >= 0 && age <= 150, `age ${age}`);
  },

  async 'Generate with a required tool: a parsed call whose arguments validate'(c) {
    const r = await serverStream(c.generation, 'Generate', {
      chat: { messages: [{ role: 'user', content: 'Weather in Oslo?' }] },
      stopping: { maxNewTokens: 120 },
      toolChoice: { mode: 'MODE_REQUIRED' },
      tools: [{ name: 'get_weather', parameters: JSON.stringify(WEATHER) }],
    });
    assert.ifError(r.err);
    const [call] = complete(r).toolCalls;
    assert.equal(call.name, 'get_weather');
    assert.equal(call.validation.result, 'VALID');
    assert.equal(typeof JSON.parse(call.arguments).city, 'string');
  },

  async 'uint64 seeds: a string or a number alike, every digit past 2^53 read, 2^63 refused'(c) {
    const sample = async (seed) => tokenIds(await serverStream(c.generation, 'Generate',
      { text: 'Once', sampling: { seed }, stopping: { maxNewTokens: 8 } })).join(',');
    assert.equal(await sample('42'), await sample(42));
    assert.notEqual(await sample('9007199254740993'), await sample('9007199254740992'));
    const r = await serverStream(c.generation, 'Generate', { text: 'x', sampling: { seed: '9223372036854775808' } });
    assert.equal(r.err && r.err.code, grpc.status.INVALID_ARGUMENT);
  },

  async 'Tokenize, Detokenize, GetModelInfo, Abort, ValidateConstraint'(c) {
    const ids = (await unary(c.generation, 'Tokenize', { text: 'Hello world' })).response.tokenIds;
    assert.deepEqual(ids, [3597, 952, 1950]);
    assert.equal((await unary(c.generation, 'Detokenize', { tokenIds: ids })).response.text, 'Hello world');
    const info = (await unary(c.generation, 'GetModelInfo', {})).response;
    assert.equal(info.architecture, 'LlamaForCausalLM');
    assert.ok(info.maxModelLen > 0);
    const aborted = await unary(c.generation, 'Abort', { requestIds: ['no-such-request'] });
    assert.ifError(aborted.err);
    assert.deepEqual(aborted.response.abortedRequestIds || [], []);
    const validated = await unary(c.generation, 'ValidateConstraint', { constraint: { regex: '[A-Z]{3}-[0-9]{4}' } });
    assert.ifError(validated.err);
    assert.ok(validated.response.grammarBackend);
  },

  async 'Embed: one unit vector per input'(c) {
    const r = await unary(c.embeddings, 'Embed', { inputs: ['a cat', 'a kitten'] });
    assert.ifError(r.err);
    assert.equal(r.response.embeddings.length, 2);
    for (const { values } of r.response.embeddings) {
      assert.equal(values.length, r.response.dimensions);
      assert.ok(Math.abs(Math.hypot(...values) - 1) < 1e-3);
    }
  },

  async 'Synthesize: PCM16 chunks in order, then a final one that counts them'(c) {
    const r = await serverStream(c.speech, 'Synthesize', { input: 'Hello there.', maxAudioSeconds: 1 });
    assert.ifError(r.err);
    const last = r.messages[r.messages.length - 1];
    assert.ok(last.final);
    assert.equal(last.format, 'AUDIO_FORMAT_PCM16');
    assert.equal(last.sampleRate, 24000);
    r.messages.forEach((m, i) => assert.equal(m.index || 0, i));
    const bytes = r.messages.reduce((n, m) => n + m.audio.length, 0);
    assert.equal(bytes, 2 * Number(last.usage.audioSamples));
  },

  async "vLLM's engine protocol: Generate whole and streamed, HealthCheck"(c) {
    const request = { requestId: 'node-vllm-1', tokenized: { inputIds: [3597, 952, 1950] }, samplingParams: { maxTokens: 8 } };
    let r = await serverStream(c.vllm, 'Generate', request);
    assert.ifError(r.err);
    assert.equal(r.messages.length, 1);
    assert.equal(r.messages[0].complete.outputIds.length, 8);
    assert.equal(r.messages[0].complete.finishReason, 'length');
    r = await serverStream(c.vllm, 'Generate', { ...request, requestId: 'node-vllm-2', stream: true });
    assert.ifError(r.err);
    assert.equal(r.messages[r.messages.length - 1].response, 'complete');
    assert.equal((await unary(c.vllm, 'HealthCheck', {})).response.healthy, true);
  },

  async 'a bad request: INVALID_ARGUMENT whose details name the field and the reason'(c) {
    const r = await serverStream(c.generation, 'Generate', { text: 'x', constraint: { regex: '[a-' } });
    assert.equal(r.err && r.err.code, grpc.status.INVALID_ARGUMENT);
    assert.ok(r.err.metadata.get('x-request-id')[0]);
    const details = errorDetails(r.err);
    assert.equal(details['google.rpc.BadRequest'].fieldViolations[0].field, 'constraint.regex');
    assert.equal(details['google.rpc.ErrorInfo'].reason, 'GRAMMAR_INVALID');
    assert.equal(details['google.rpc.ErrorInfo'].domain, 'stencil.dev');
    for (const bad of [{ constraint: { regex: 'a', backend: 99 } }, { sampling: { temperature: NaN } }]) {
      const refused = await serverStream(c.generation, 'Generate', { text: 'x', ...bad });
      assert.equal(refused.err && refused.err.code, grpc.status.INVALID_ARGUMENT, JSON.stringify(bad));
    }
  },

  async 'a stream cancelled, out of time, or aborted ends so; its id is free again'(c) {
    const cancelled = await serverStream(c.generation, 'Generate', { requestId: 'node-cancel', text: 'Once', stopping: LONG },
      within(), (message, call) => { if (message.response === 'chunk') call.cancel(); });
    assert.equal(cancelled.err && cancelled.err.code, grpc.status.CANCELLED);
    const late = await serverStream(c.generation, 'Generate', { text: 'Once', stopping: LONG }, within(1));
    assert.equal(late.err && late.err.code, grpc.status.DEADLINE_EXCEEDED);
    let abort = null;
    const aborted = await serverStream(c.generation, 'Generate', { requestId: 'node-abort', text: 'Once', stopping: LONG },
      within(), () => { abort = abort || unary(c.generation, 'Abort', { requestIds: ['node-abort'] }); });
    assert.deepEqual((await abort).response.abortedRequestIds, ['node-abort']);
    assert.equal(complete(aborted).finishReason, 'CANCELLED');
    const again = await serverStream(c.generation, 'Generate', { requestId: 'node-cancel', text: 'x', stopping: { maxNewTokens: 2 } });
    assert.ifError(again.err);
  },

  async 'gzip-compressed calls'() {
    const gzip = connect({ 'grpc.default_compression_algorithm': 2 });
    try {
      const r = await serverStream(gzip.generation, 'Generate', { text: 'Hello '.repeat(100), stopping: { maxNewTokens: 4 } });
      assert.ifError(r.err);
      assert.ifError((await unary(gzip.embeddings, 'Embed', { inputs: ['a'] })).err);
    } finally {
      gzip.generation.close();
    }
  },
};

async function main() {
  const c = connect();
  // `stencild serve` answers before its models are loaded (health NOT_SERVING).
  for (let i = 0; ; i++) {
    const r = await unary(c.health, 'Check', {}, within(5));
    if (r.response && r.response.status === 'SERVING') break;
    if (i === 240) throw new Error('the server never became SERVING');
    await new Promise((resolve) => setTimeout(resolve, 500));
  }
  let failed = 0;
  for (const [name, check] of Object.entries(checks)) {
    try {
      await check(c);
      console.log(`ok   ${name}`);
    } catch (e) {
      failed += 1;
      console.log(`FAIL ${name}: ${e.stack || e}`);
    }
  }
  c.generation.close();
  console.log(failed ? `${failed} of ${Object.keys(checks).length} checks failed` : `all ${Object.keys(checks).length} checks passed`);
  process.exit(failed ? 1 : 0);
}

main().catch((e) => { console.error(e); process.exit(2); });
