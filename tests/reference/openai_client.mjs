// OpenAI's own client library (the npm package openai, fetched by deploy/fetch-test-data.sh) against
// `fusion serve`, as an application would use it: list the models, stream a chat completion, ask the
// same chat without streaming, ask a text completion, and send a request the gateway must refuse.
// Prints one JSON object of what it saw; test_e2e_serve checks it.
//
//   node tests/reference/openai_client.mjs MODULES_DIR BASE_URL API_KEY MODEL
import path from "path";
import { createRequire } from "module";

const [modulesDir, baseURL, apiKey, model] = process.argv.slice(2);
if (!model) {
  console.error("usage: node openai_client.mjs MODULES_DIR BASE_URL API_KEY MODEL");
  process.exit(2);
}
const require = createRequire(path.join(path.resolve(modulesDir), "x.js"));
const OpenAI = require("openai").default ?? require("openai");
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 120000 });

const messages = [
  { role: "system", content: "You answer briefly." },
  { role: "user", content: "Name three colours." },
];
const ask = { model, messages, max_tokens: 12, temperature: 0.7, top_p: 0.9, seed: 42 };
const out = {};

out.models = (await client.models.list()).data.map((m) => m.id);

const stream = await client.chat.completions.create({ ...ask, stream: true, stream_options: { include_usage: true } });
let text = "", chunks = 0, role = null, finish = null, usage = null;
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  if (!chunk.choices.length) continue;
  const c = chunk.choices[0];
  if (c.delta.role) role = c.delta.role;
  if (c.delta.content) { text += c.delta.content; chunks++; }
  if (c.finish_reason) finish = c.finish_reason;
  out.stream_id = chunk.id;
}
Object.assign(out, { stream_text: text, stream_chunks: chunks, stream_role: role, stream_finish: finish, stream_usage: usage });

const whole = await client.chat.completions.create(ask);
out.whole_text = whole.choices[0].message.content;
out.whole_finish = whole.choices[0].finish_reason;
out.whole_usage = whole.usage;

const comp = await client.completions.create({ model, prompt: "Once upon a time", max_tokens: 12, temperature: 0 });
out.completion_text = comp.choices[0].text;

try {
  await client.chat.completions.create({ ...ask, n: 2 });
  out.refused = null;
} catch (e) {
  out.refused = { status: e.status, param: e.param ?? e.error?.param ?? null };
}
console.log(JSON.stringify(out));
