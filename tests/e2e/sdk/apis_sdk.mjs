// kvserve's POST /v1/messages and POST /v1/responses driven by the official
// clients (@anthropic-ai/sdk, openai) on the built-in default model: each
// answer is checked against /v1/chat/completions for the same request (the
// route both map onto), whole and through the clients' stream accumulators,
// with a grammar-forced tool call and its round trip, and the clients' typed
// errors for bad input. Exit 77 = skipped (no binary, model or packages).
import { spawn } from 'node:child_process';
import { existsSync } from 'node:fs';
import { dirname } from 'node:path';
import assert from 'node:assert/strict';

const SKIP = 77;
const KEY = 'k-sdk';
const bin = process.env.KVSERVE_BIN;
if (!bin || !existsSync(bin)) { console.log('skipped: KVSERVE_BIN not set or missing'); process.exit(SKIP); }
const model = `${dirname(bin)}/default-model.gguf`;
if (!existsSync(model)) { console.log(`skipped: ${model} not found`); process.exit(SKIP); }
let Anthropic, OpenAI;
try {
  Anthropic = (await import('@anthropic-ai/sdk')).default;
  OpenAI = (await import('openai')).default;
} catch (e) {
  console.log('skipped: @anthropic-ai/sdk or openai is not installed (npm ci in tests/e2e/sdk)');
  process.exit(SKIP);
}

function startServer(args) {
  return new Promise((resolve, reject) => {
    const p = spawn(bin, ['serve', '-m', model, '--alias', 'x', '--port', '0', '-c', '1024', '--parallel', '2', '-t', '1', ...args],
      { stdio: ['ignore', 'ignore', 'pipe'] });
    let log = '';
    const timer = setTimeout(() => reject(new Error('server did not start:\n' + log)), 60000);
    p.stderr.on('data', (d) => {
      log += d;
      const m = log.match(/http:\/\/127\.0\.0\.1:(\d+)/);
      if (m && !p.port) { p.port = +m[1]; clearTimeout(timer); resolve(p); }
    });
    p.on('exit', (code) => { p.exitCode_ = code; if (!p.port) reject(new Error(`server exited ${code}:\n${log}`)); });
    p.log = () => log;
  });
}

const weather = { type: 'object', properties: { city: { type: 'string', minLength: 1, maxLength: 8 } }, required: ['city'] };

async function anthropic(base, openai) {
  const client = new Anthropic({ baseURL: base, apiKey: KEY, maxRetries: 0 });
  const system = 'You tell stories.';
  const ask = [{ role: 'user', content: 'Tell me a story' }];
  const ref = await openai.chat.completions.create({ model: 'x', messages: [{ role: 'system', content: system }, ...ask],
    max_tokens: 16, temperature: 1 });
  const refText = ref.choices[0].message.content;

  const m = await client.messages.create({ model: 'x', system, messages: ask, max_tokens: 16, temperature: 1 });
  assert.equal(m.type, 'message');
  assert.equal(m.content[0].type, 'text');
  assert.equal(m.content[0].text, refText);
  assert.equal(m.stop_reason, 'max_tokens');
  // the prompt in Anthropic's parts: computed and read from the prefix cache (the chat request computed it)
  assert.equal(m.usage.input_tokens + m.usage.cache_read_input_tokens, ref.usage.prompt_tokens);
  assert.ok(m.usage.cache_read_input_tokens > 0);
  assert.equal(m.usage.cache_creation_input_tokens, 0);
  assert.equal(m.usage.output_tokens, 16);
  const count = await client.messages.countTokens({ model: 'x', system, messages: ask });
  assert.equal(count.input_tokens, ref.usage.prompt_tokens);

  const stream = client.messages.stream({ model: 'x', system, messages: ask, max_tokens: 16, temperature: 1 });
  let text = '';
  stream.on('text', (t) => { text += t; });
  const fin = await stream.finalMessage();
  assert.equal(text, refText);
  assert.deepEqual(fin.content, m.content);
  assert.equal(fin.stop_reason, 'max_tokens');
  assert.equal(fin.usage.output_tokens, 16);

  const tools = [{ name: 'get_weather', description: 'The weather in a city', input_schema: weather }];
  const q = [{ role: 'user', content: 'What is the weather in Paris?' }];
  const body = { model: 'x', messages: q, tools, tool_choice: { type: 'tool', name: 'get_weather' }, max_tokens: 120, temperature: 0 };
  const call = await client.messages.create(body);
  const use = call.content.find((b) => b.type === 'tool_use');
  assert.equal(call.stop_reason, 'tool_use');
  assert.equal(use.name, 'get_weather');
  assert.equal(typeof use.input.city, 'string');
  const streamed = await client.messages.stream(body).finalMessage();
  const suse = streamed.content.find((b) => b.type === 'tool_use');
  assert.deepEqual(suse.input, use.input);
  assert.equal(streamed.stop_reason, 'tool_use');
  const back = await client.messages.create({ model: 'x', tools, max_tokens: 4, temperature: 0, messages: [...q,
    { role: 'assistant', content: call.content },
    { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: '18 degrees' }] }] });
  assert.equal(back.type, 'message');
  assert.ok(back.usage.input_tokens + back.usage.cache_read_input_tokens >
            call.usage.input_tokens + call.usage.cache_read_input_tokens);

  await assert.rejects(client.messages.create({ model: 'x', messages: q }), (e) =>
    e instanceof Anthropic.BadRequestError && e.error.type === 'error' && e.error.error.type === 'invalid_request_error');
  const wrong = new Anthropic({ baseURL: base, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(wrong.messages.create({ model: 'x', messages: q, max_tokens: 2 }), Anthropic.AuthenticationError);
  console.log(`anthropic: ok (text ${JSON.stringify(refText)}, tool_use ${JSON.stringify(use.input)})`);
}

async function responses(openai) {
  const ref = await openai.chat.completions.create({ model: 'x', max_tokens: 16, temperature: 1,
    messages: [{ role: 'system', content: 'You tell stories.' }, { role: 'user', content: 'Tell me a story' }] });
  const refText = ref.choices[0].message.content;
  const body = { model: 'x', instructions: 'You tell stories.', input: 'Tell me a story', max_output_tokens: 16, temperature: 1 };
  const r = await openai.responses.create(body);
  assert.equal(r.output_text, refText);
  assert.equal(r.status, 'incomplete');
  assert.equal(r.usage.input_tokens, ref.usage.prompt_tokens);
  assert.equal(r.usage.output_tokens, 16);

  const stream = openai.responses.stream(body);
  let text = '';
  stream.on('response.output_text.delta', (e) => { text += e.delta; });
  const fin = await stream.finalResponse();
  assert.equal(text, refText);
  assert.equal(fin.output_text, refText);

  const tools = [{ type: 'function', name: 'get_weather', description: 'The weather in a city', parameters: weather, strict: false }];
  const tb = { model: 'x', input: 'What is the weather in Paris?', tools, tool_choice: 'required', max_output_tokens: 120, temperature: 0 };
  const call = await openai.responses.create(tb);
  const fc = call.output.find((o) => o.type === 'function_call');
  assert.equal(fc.name, 'get_weather');
  assert.equal(typeof JSON.parse(fc.arguments).city, 'string');
  const sfin = await openai.responses.stream(tb).finalResponse();
  assert.equal(sfin.output.find((o) => o.type === 'function_call').arguments, fc.arguments);
  const back = await openai.responses.create({ model: 'x', tools, max_output_tokens: 4, temperature: 0, input: [
    { role: 'user', content: 'What is the weather in Paris?' }, fc,
    { type: 'function_call_output', call_id: fc.call_id, output: '18 degrees' }] });
  assert.equal(back.object, 'response');
  assert.ok(back.usage.input_tokens > call.usage.input_tokens);

  await assert.rejects(openai.responses.create({ model: 'x', input: 'x', tools: [{ type: 'web_search' }] }), (e) =>
    e instanceof OpenAI.BadRequestError && /tools\[0\]/.test(e.message));
  console.log(`responses: ok (text ${JSON.stringify(refText)}, function_call ${fc.arguments})`);
}

const p = await startServer(['--api-key', KEY, '--seed', '7']);
try {
  const base = `http://127.0.0.1:${p.port}`;
  const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: KEY, maxRetries: 0 });
  await anthropic(base, openai);
  await responses(openai);
} finally {
  const code = await new Promise((resolve) => {
    if (p.exitCode_ !== undefined) return resolve(p.exitCode_);
    p.on('exit', resolve);
    p.kill('SIGTERM');
  });
  if (code !== 0) console.log(p.log());
  assert.equal(code, 0, 'the server shuts down cleanly');
}
