// node model-catalog.mjs CODEX OUT: write the model catalog the harness launcher gives Codex for the policy.
//
// Codex looks every model up in its catalog; a model it does not know (the policy is served as
// "policy") runs on fallback metadata, with a warning on every start and no apply_patch tool. Its
// `model_catalog_json` setting names a file of extra entries, and an entry must carry the model's
// base instructions (the system prompt). This script asks the Codex binary CODEX itself for the
// instructions it gives an unknown model: it runs `codex exec` once against a loopback server of its
// own, takes the instructions from the one request Codex sends, and writes OUT, a one-model catalog
// whose slug is the placeholder @LEGORL_MODEL@ (the launcher puts the run's model name there).
// So the policy sees Codex's own prompt, unchanged, plus the apply_patch tool Codex gives its own
// models. Run at build time (the harness image, scripts/get-harnesses.sh); needs Node.js >= 18 and
// nothing else. No request leaves the machine: the provider is this script's server.
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync, mkdirSync } from "node:fs";
import { createServer } from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";

const [codex, out] = process.argv.slice(2);
if (!codex || !out) {
  console.error("usage: node model-catalog.mjs CODEX_BINARY OUT.json");
  process.exit(2);
}

function event(type, data) {
  return `event: ${type}\ndata: ${JSON.stringify({ type, ...data })}\n\n`;
}

// One streamed answer that ends the turn: a short message and `response.completed`.
function answer() {
  const response = { id: "resp_catalog", object: "response", status: "in_progress", model: "policy", output: [] };
  const item = {
    type: "message",
    id: "msg_catalog",
    role: "assistant",
    status: "completed",
    content: [{ type: "output_text", text: "ok", annotations: [] }],
  };
  const usage = { input_tokens: 1, output_tokens: 1, total_tokens: 2 };
  return (
    event("response.created", { response }) +
    event("response.output_item.done", { output_index: 0, item }) +
    event("response.completed", { response: { ...response, status: "completed", output: [item], usage } })
  );
}

const requests = [];
const server = createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", () => {
    if (req.method !== "POST" || !req.url.endsWith("/responses")) {
      res.writeHead(404).end();
      return;
    }
    requests.push(JSON.parse(Buffer.concat(chunks).toString("utf8")));
    res.writeHead(200, { "content-type": "text/event-stream" }).end(answer());
  });
});
await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
const base = `http://127.0.0.1:${server.address().port}/v1`;

const tmp = mkdtempSync(join(tmpdir(), "legorl-codex-catalog-"));
const home = join(tmp, "codex-home");
const work = join(tmp, "work");
mkdirSync(home);
mkdirSync(work);
writeFileSync(
  join(home, "config.toml"),
  [
    'model = "policy"',
    'model_provider = "catalog"',
    "check_for_update_on_startup = false",
    'web_search = "disabled"',
    "[model_providers.catalog]",
    'name = "catalog"',
    `base_url = "${base}"`,
    'env_key = "OPENAI_API_KEY"',
    'wire_api = "responses"',
    "[analytics]",
    "enabled = false",
    "[feedback]",
    "enabled = false",
    "[otel]",
    'exporter = "none"',
    "[history]",
    'persistence = "none"',
    "",
  ].join("\n"),
);

const log = [];
let code;
try {
  code = await new Promise((resolve, reject) => {
    const child = spawn(
      codex,
      ["exec", "--skip-git-repo-check", "--disable", "plugins", "--dangerously-bypass-approvals-and-sandbox",
        "--cd", work, "-"],
      {
        env: { PATH: process.env.PATH || "/usr/bin:/bin", HOME: tmp, CODEX_HOME: home, OPENAI_API_KEY: "catalog" },
        stdio: ["pipe", "ignore", "pipe"],
      },
    );
    child.stderr.on("data", (c) => log.push(c));
    const timer = setTimeout(() => child.kill("SIGKILL"), 120_000);
    child.on("error", reject);
    child.on("exit", (status, signal) => {
      clearTimeout(timer);
      resolve(status ?? signal);
    });
    child.stdin.on("error", () => {}); // a binary that exits early: its exit status says what went wrong
    child.stdin.end("Reply with one word.\n");
  });
} finally {
  server.close();
  rmSync(tmp, { recursive: true, force: true });
}
if (code !== 0 || requests.length !== 1) {
  process.stderr.write(Buffer.concat(log));
  console.error(`model-catalog: codex exited ${code} after ${requests.length} requests (expected 0 after 1)`);
  process.exit(1);
}

// Codex sends the base instructions as `instructions`, or (0.171) as the first input item, a
// developer message.
const [request] = requests;
let instructions = typeof request.instructions === "string" ? request.instructions : "";
const first = Array.isArray(request.input) ? request.input[0] : undefined;
if (!instructions && first?.type === "message" && first.role === "developer" && first.content?.length === 1) {
  instructions = first.content[0].text;
}
if (typeof instructions !== "string" || !instructions.trim()) {
  console.error("model-catalog: found no base instructions in the request Codex sent");
  process.exit(1);
}

// What Codex's fallback metadata says for an unknown model, except the apply_patch tool (freeform,
// as Codex's own models have it); the context window is left to `model_context_window`.
const model = {
  slug: "@LEGORL_MODEL@",
  display_name: "@LEGORL_MODEL@",
  description: "The policy being trained, served through the legorl proxy.",
  supported_reasoning_levels: [],
  shell_type: "unified_exec",
  visibility: "list",
  supported_in_api: true,
  priority: 0,
  upgrade: null,
  base_instructions: instructions,
  supports_reasoning_summaries: false,
  support_verbosity: false,
  default_verbosity: null,
  apply_patch_tool_type: "freeform",
  truncation_policy: { mode: "bytes", limit: 10000 },
  supports_parallel_tool_calls: false,
  experimental_supported_tools: [],
};
writeFileSync(out, `${JSON.stringify({ models: [model] }, null, 1)}\n`);
console.error(`model-catalog: wrote ${out} (base instructions: ${instructions.length} characters)`);
