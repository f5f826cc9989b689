// Real clients from npm against `kvserve serve`, unchanged: the Vercel AI SDK
// through @ai-sdk/openai-compatible (generateText, streamText, generateObject
// with a zod schema, a tool call) and LangChain's ChatOpenAI (invoke, stream,
// structured output) and OpenAIEmbeddings (base64 vectors, decoded by the client), and the openai client's
// reasoning_content (whole and streamed) and embeddings. Each answer is checked against the same request sent
// as plain JSON (temperature 0: the same text), or against its schema.
// Exits 77 when the packages or the model are missing.
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import assert from 'node:assert/strict';

const SKIP = 77;
const bin = process.env.KVSERVE_BIN;
const shared = process.env.KVSERVE_SHARED || '../shared';
const model = `${shared}/models/trained/tiny-llama-gqa-hd64-f32.gguf`;
if (!bin || !existsSync(bin) || !existsSync(model)) { console.log('skipped: KVSERVE_BIN or the trained model missing'); process.exit(SKIP); }
let ai, compat, lc, z, OpenAI;
try {
  OpenAI = (await import('openai')).default;
  ai = await import('ai');
  compat = await import('@ai-sdk/openai-compatible');
  lc = await import('@langchain/openai');
  z = (await import('zod')).z;
} catch (e) {
  console.log('skipped: the client packages are not installed (npm ci in tests/e2e): ' + e.message); process.exit(SKIP);
}

// ChatML that also renders an assistant's reasoning, and whose generation prompt opens <think> when the
// request's chat_template_kwargs say think (DeepSeek-R1's way): only the reasoning checks ask for it
const tmp = mkdtempSync(join(tmpdir(), 'kvserve-clients-'));
const template = join(tmp, 'think.jinja');
writeFileSync(template, "{%- for m in messages -%}<|im_start|>{{ m.role }}\n" +
  "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}" +
  "{% if m.content is string %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor -%}" +
  "{%- if add_generation_prompt -%}<|im_start|>assistant\n{% if think %}<think>\n{% endif %}{%- endif -%}");

function startServer() {
  return new Promise((resolve, reject) => {
    const p = spawn(bin, ['serve', '-m', model, '--alias', 'x', '--port', '0', '-c', '1024', '--parallel', '4',
                          '--embeddings', '--pooling', 'mean', '--chat-template-file', template],
                    { stdio: ['ignore', 'ignore', 'pipe'] });
    let log = '';
    const timer = setTimeout(() => reject(new Error('server did not start:\n' + log)), 60000);
    p.stderr.on('data', (d) => {
      log += d;
      const m = log.match(/http:\/\/127\.0\.0\.1:(\d+)/);
      if (m && !p.port) { p.port = +m[1]; clearTimeout(timer); resolve(p); }
    });
    p.on('exit', (code) => { if (!p.port) reject(new Error(`server exited ${code}:\n${log}`)); });
  });
}

const p = await startServer();
const base = `http://127.0.0.1:${p.port}/v1`;
let failures = 0;
async function check(name, fn) {
  try { await fn(); console.log('ok   ' + name); } catch (e) { failures++; console.log('FAIL ' + name + ': ' + (e.stack || e)); }
}
async function raw(messages, extra = {}) {
  const r = await fetch(`${base}/chat/completions`, { method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ model: 'x', messages, temperature: 0, max_tokens: 24, ...extra }) });
  assert.equal(r.status, 200);
  return r.json();
}

try {
  const provider = compat.createOpenAICompatible({ name: 'kvserve', baseURL: base, apiKey: 'none', supportsStructuredOutputs: true });
  const chat = provider.chatModel('x');
  const prompt = 'Once upon a time';
  const want = await raw([{ role: 'user', content: prompt }]);
  const wantText = want.choices[0].message.content;

  await check('ai: generateText is the plain request\'s text and usage', async () => {
    const g = await ai.generateText({ model: chat, prompt, temperature: 0, maxOutputTokens: 24 });
    assert.equal(g.text, wantText);
    assert.ok(g.text.length > 0);
    assert.equal(g.usage.inputTokens, want.usage.prompt_tokens);
    assert.equal(g.usage.outputTokens, want.usage.completion_tokens);
    assert.equal(g.finishReason, 'length');
  });
  await check('ai: streamText streams the same text', async () => {
    const s = ai.streamText({ model: chat, prompt, temperature: 0, maxOutputTokens: 24 });
    let text = '';
    for await (const d of s.textStream) text += d;
    assert.equal(text, wantText);
  });
  await check('ai: generateObject fills a zod schema (integer bounds and an enum held by the grammar)', async () => {
    const schema = z.object({ name: z.string().max(12), age: z.number().int().min(0).max(120),
                              pet: z.enum(['cat', 'dog', 'none']) });
    const o = await ai.generateObject({ model: chat, schema, prompt: 'Describe a person as JSON.', temperature: 0,
                                        maxOutputTokens: 80 });
    assert.ok(schema.safeParse(o.object).success, JSON.stringify(o.object));
  });
  await check('ai: a required tool call arrives parsed, its input valid for the tool\'s schema', async () => {
    const input = z.object({ city: z.string().max(16), days: z.number().int().min(1).max(7) });
    const g = await ai.generateText({
      model: chat, prompt: 'What is the weather in Paris for three days?', temperature: 0, maxOutputTokens: 80,
      tools: { weather: ai.tool({ description: 'The forecast for a city', inputSchema: input }) },
      toolChoice: 'required',
    });
    assert.equal(g.toolCalls.length >= 1, true, JSON.stringify(g.content));
    assert.equal(g.toolCalls[0].toolName, 'weather');
    assert.ok(input.safeParse(g.toolCalls[0].input).success, JSON.stringify(g.toolCalls[0].input));
  });

  const oa = new OpenAI({ baseURL: base, apiKey: 'none', maxRetries: 0 });
  await check('openai: reasoning_content whole and in stream deltas, cut by max_tokens still reasoning', async () => {
    const body = { model: 'x', messages: [{ role: 'user', content: prompt }], temperature: 0, max_tokens: 12,
                   chat_template_kwargs: { think: true } };
    const r = await oa.chat.completions.create(body);
    const m = r.choices[0].message;
    const none = await oa.chat.completions.create({ ...body, reasoning_format: 'none' });
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.ok(m.reasoning_content.length > 0 && !m.content, JSON.stringify(m));
    assert.equal(m.reasoning_content, none.choices[0].message.content.trim());
    assert.equal(none.choices[0].message.reasoning_content, undefined);
    let reasoning = '', content = '';
    for await (const c of await oa.chat.completions.create({ ...body, stream: true })) {
      reasoning += c.choices[0]?.delta?.reasoning_content ?? '';
      content += c.choices[0]?.delta?.content ?? '';
    }
    assert.equal(reasoning, m.reasoning_content);
    assert.equal(content, '');
  });

  const lcChat = new lc.ChatOpenAI({ model: 'x', temperature: 0, maxTokens: 24, apiKey: 'none', configuration: { baseURL: base } });
  await check('langchain: ChatOpenAI.invoke is the plain request\'s text', async () => {
    const r = await lcChat.invoke(prompt);
    assert.equal(r.content, wantText);
    assert.equal(r.usage_metadata.input_tokens, want.usage.prompt_tokens);
  });
  await check('langchain: ChatOpenAI.stream streams the same text', async () => {
    let text = '';
    for await (const c of await lcChat.stream(prompt)) text += c.content;
    assert.equal(text, wantText);
  });
  await check('langchain: withStructuredOutput returns an object of the schema', async () => {
    const schema = z.object({ title: z.string().max(20), year: z.number().int().min(1900).max(2100) });
    const structured = new lc.ChatOpenAI({ model: 'x', temperature: 0, maxTokens: 80, apiKey: 'none',
                                           configuration: { baseURL: base } }).withStructuredOutput(schema, { method: 'jsonSchema' });
    const o = await structured.invoke('A film as JSON.');
    assert.ok(schema.safeParse(o).success, JSON.stringify(o));
  });
  const texts = ['The cat sat on the mat.', 'Once upon a time'];
  const rawEmbed = async (input) => {
    const r = await fetch(`${base}/embeddings`, { method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ model: 'x', input }) });
    assert.equal(r.status, 200);
    return (await r.json()).data.map((d) => d.embedding);
  };
  const close = (a, b) => a.length === b.length && a.every((x, i) => Math.abs(x - b[i]) < 1e-5);
  const wantVec = await rawEmbed(texts);
  await check('ai: embedMany gives the route\'s vectors', async () => {
    const em = provider.textEmbeddingModel ? provider.textEmbeddingModel('x') : provider.embeddingModel('x');
    const r = await ai.embedMany({ model: em, values: texts });
    assert.ok(r.embeddings.length === 2 && r.embeddings.every((v, i) => close(v, wantVec[i])));
  });
  await check('openai: embeddings.create (base64 on the wire, decoded by the client) gives the route\'s vectors', async () => {
    const r = await oa.embeddings.create({ model: 'x', input: texts });
    assert.ok(r.data.length === 2 && r.data.every((d, i) => d.index === i && close(d.embedding, wantVec[i])));
    assert.ok(r.usage.prompt_tokens > 0 && r.usage.total_tokens === r.usage.prompt_tokens, JSON.stringify(r.usage));
  });
  await check('langchain: OpenAIEmbeddings embeds documents and a query as the route does', async () => {
    const e = new lc.OpenAIEmbeddings({ model: 'x', apiKey: 'none', configuration: { baseURL: base } });
    const docs = await e.embedDocuments(texts);
    assert.equal(docs.length, 2);
    assert.ok(docs.every((v, i) => close(v, wantVec[i])));
    assert.ok(close(await e.embedQuery(texts[1]), wantVec[1]));
    const norm = Math.sqrt(wantVec[0].reduce((a, x) => a + x * x, 0));
    assert.ok(Math.abs(norm - 1) < 1e-4, `normalized (${norm})`);
  });
} finally {
  p.kill('SIGTERM');
  rmSync(tmp, { recursive: true, force: true });
}
process.exit(failures ? 1 : 0);
