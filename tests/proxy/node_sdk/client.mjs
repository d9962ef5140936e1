// The official openai Node SDK (its fetch, undici with keep-alive) against the proxy.
//
//   node client.mjs BASE_URL SCENARIO
//
// Prints one JSON object on stdout with what the scenario saw; tests/proxy/test_node_sdk.py
// asserts on it. An unexpected error prints {"error": ...} and exits 1.
import OpenAI from "openai";
import { createInterface } from "node:readline";

const [baseURL, scenario] = process.argv.slice(2);
if (!baseURL || !scenario) {
  console.error("usage: node client.mjs BASE_URL SCENARIO");
  process.exit(2);
}

const MODEL = "specroute/twin";
const MESSAGES = [{ role: "user", content: "Explain speculative decoding in one line." }];

const stdin = createInterface({ input: process.stdin })[Symbol.asyncIterator]();

// The next line the test writes on stdin (null once stdin closed).
async function stdinLine() {
  const { value, done } = await stdin.next();
  return done ? null : value;
}

function newClient() {
  return new OpenAI({ baseURL, apiKey: "none", maxRetries: 0, timeout: 60_000 });
}

// Everything a streamed chat completion showed the client.
async function readChatStream(stream) {
  const out = { chunks: 0, text: "", usage: [], finish: null, lastChoiceFinish: null, ids: new Set() };
  for await (const chunk of stream) {
    out.chunks += 1;
    out.ids.add(chunk.id);
    if (chunk.usage) out.usage.push(chunk.usage);
    for (const choice of chunk.choices) {
      out.text += choice.delta?.content ?? "";
      out.lastChoiceFinish = choice.finish_reason ?? null;
      out.finish = choice.finish_reason ?? out.finish;
    }
  }
  out.ids = [...out.ids];
  return out;
}

function errorShape(err) {
  return {
    name: err?.constructor?.name ?? null,
    isAPIError: err instanceof OpenAI.APIError,
    isBadRequest: err instanceof OpenAI.BadRequestError,
    isNotFound: err instanceof OpenAI.NotFoundError,
    status: err?.status ?? null,
    message: err?.message ?? String(err),
    error: err?.error ?? null, // the body's "error" object, as the SDK parsed it
    requestID: err?.requestID ?? null,
  };
}

const scenarios = {
  // a. Non-streamed chat, with the response's headers.
  async chat() {
    const client = newClient();
    const { data, response } = await client.chat.completions
      .create({ model: MODEL, messages: MESSAGES, max_tokens: 12 })
      .withResponse();
    const raw = await client.chat.completions
      .create({ model: MODEL, messages: MESSAGES, max_tokens: 3 })
      .asResponse();
    const rawBody = await raw.json();
    return {
      id: data.id,
      model: data.model,
      object: data.object,
      content: data.choices[0].message.content,
      finish: data.choices[0].finish_reason,
      usage: data.usage,
      headers: Object.fromEntries(response.headers.entries()),
      requestID: data._request_id ?? null,
      raw: { status: raw.status, headers: Object.fromEntries(raw.headers.entries()), usage: rawBody.usage },
    };
  },

  // b. Streamed chat: with and without stream_options, and the non-streamed count for the same
  // max_tokens with ignore_eos.
  async chatStream() {
    const client = newClient();
    const body = { model: MODEL, messages: MESSAGES, max_tokens: 24, ignore_eos: true };
    const plain = await client.chat.completions.create(body);
    const withUsage = await readChatStream(
      await client.chat.completions.create({ ...body, stream: true, stream_options: { include_usage: true } }),
    );
    const withoutUsage = await readChatStream(await client.chat.completions.create({ ...body, stream: true }));
    return { nonStreamedUsage: plain.usage, withUsage, withoutUsage };
  },

  // c. Legacy completions, both ways.
  async completions() {
    const client = newClient();
    const plain = await client.completions.create({ model: MODEL, prompt: "Once upon a time", max_tokens: 9 });
    const stream = await client.completions.create({
      model: MODEL,
      prompt: "Once",
      max_tokens: 7,
      stream: true,
      stream_options: { include_usage: true },
    });
    const streamed = { chunks: 0, text: "", finish: null, usage: [] };
    for await (const chunk of stream) {
      streamed.chunks += 1;
      if (chunk.usage) streamed.usage.push(chunk.usage);
      for (const choice of chunk.choices) {
        streamed.text += choice.text ?? "";
        streamed.finish = choice.finish_reason ?? streamed.finish;
      }
    }
    const bare = await client.completions.create({ model: MODEL, prompt: "Once", max_tokens: 5, stream: true });
    const bareChunks = [];
    for await (const chunk of bare) bareChunks.push(chunk);
    return {
      plain: { text: plain.choices[0].text, finish: plain.choices[0].finish_reason, usage: plain.usage, object: plain.object },
      streamed,
      bare: {
        chunks: bareChunks.length,
        text: bareChunks.map((c) => c.choices.map((x) => x.text ?? "").join("")).join(""),
        withUsage: bareChunks.filter((c) => c.usage).length,
        withoutChoices: bareChunks.filter((c) => !c.choices || c.choices.length === 0).length,
      },
    };
  },

  // d. Errors: the SDK's typed exceptions.
  async errors() {
    const client = newClient();
    const attempts = {
      negativeMaxTokens: () => client.chat.completions.create({ model: MODEL, messages: MESSAGES, max_tokens: -1 }),
      missingMessages: () => client.chat.completions.create({ model: MODEL, max_tokens: 4 }),
      negativeMaxTokensStreamed: async () => {
        const stream = await client.chat.completions.create({
          model: MODEL,
          messages: MESSAGES,
          max_tokens: -1,
          stream: true,
        });
        for await (const _ of stream);
      },
      noSuchRoute: () => client.post("/no/such/route", { body: { model: MODEL } }),
      noSuchModel: () => client.models.retrieve("no-such-model"),
    };
    const out = {};
    for (const [name, attempt] of Object.entries(attempts)) {
      try {
        await attempt();
        out[name] = { resolved: true };
      } catch (err) {
        out[name] = errorShape(err);
      }
    }
    return out;
  },

  // e. Keep-alive: 20 streams one after the other on one client, then a non-streamed one.
  async keepAlive() {
    const client = newClient();
    const results = [];
    for (let i = 0; i < 20; i++) {
      const stream = await client.chat.completions.create({
        model: MODEL,
        messages: [{ role: "user", content: `Request ${i}` }],
        max_tokens: 5 + (i % 4),
        ignore_eos: true,
        stream: true,
        stream_options: { include_usage: true },
      });
      const r = await readChatStream(stream);
      results.push({ text: r.text, finish: r.finish, completionTokens: r.usage.at(-1)?.completion_tokens ?? null });
    }
    const after = await client.chat.completions.create({ model: MODEL, messages: MESSAGES, max_tokens: 2 });
    return { results, after: after.usage };
  },

  // f. Abort a long stream. After 5 chunks it prints {"streaming": ...} and waits for a line on
  // stdin (the test looks at the proxy and the twin meanwhile), then aborts with the
  // AbortController, prints the result and waits for stdin to close, so that the test looks
  // again while this process and its connection pool are still alive.
  async abort() {
    const client = newClient();
    const controller = new AbortController();
    const stream = await client.chat.completions.create(
      { model: MODEL, messages: MESSAGES, max_tokens: 4000, ignore_eos: true, stream: true },
      { signal: controller.signal },
    );
    let chunks = 0;
    let text = "";
    let caught = null;
    try {
      for await (const chunk of stream) {
        chunks += 1;
        text += chunk.choices[0]?.delta?.content ?? "";
        if (chunks === 5) {
          process.stdout.write(JSON.stringify({ streaming: chunks }) + "\n");
          await stdinLine();
          controller.abort();
        }
      }
    } catch (err) {
      caught = errorShape(err);
    }
    return { chunks, text, caught, aborted: controller.signal.aborted, holdOpen: true };
  },

  // An upstream that drops the connection after 3 chunks (tests/proxy/proxy_faults.py, cut:3):
  // the proxy cannot fail over once bytes went out; the SDK must see an error, not a short answer.
  async midStreamCut() {
    const client = newClient();
    const stream = await client.chat.completions.create({ model: MODEL, messages: MESSAGES, max_tokens: 50, stream: true });
    let chunks = 0;
    let caught = null;
    try {
      for await (const _ of stream) chunks += 1;
    } catch (err) {
      caught = errorShape(err);
    }
    return { chunks, caught };
  },

  // g. 16 streams at once on one client.
  async concurrent() {
    const client = newClient();
    const results = await Promise.all(
      Array.from({ length: 16 }, async (_, i) => {
        const stream = await client.chat.completions.create({
          model: MODEL,
          messages: [{ role: "user", content: `Concurrent ${i}` }],
          max_tokens: 8 + i,
          ignore_eos: true,
          stream: true,
          stream_options: { include_usage: true },
        });
        const r = await readChatStream(stream);
        return {
          maxTokens: 8 + i,
          text: r.text,
          finish: r.finish,
          ids: r.ids,
          completionTokens: r.usage.at(-1)?.completion_tokens ?? null,
        };
      }),
    );
    return { results };
  },

  // i. The Responses API: an answer, a stream, a follow-up naming the first answer, a retrieve.
  async responses() {
    const client = newClient();
    const { data: first, response } = await client.responses
      .create({ model: MODEL, input: "Name a river.", instructions: "Be brief.", max_output_tokens: 14 })
      .withResponse();
    const stream = await client.responses.create({ model: MODEL, input: "Name a sea.", max_output_tokens: 22, stream: true });
    const events = [];
    let text = "";
    let last = null;
    for await (const event of stream) {
      events.push(event.type);
      if (event.type === "response.output_text.delta") text += event.delta;
      if (event.response) last = event.response;
    }
    const { data: follow, response: followResponse } = await client.responses
      .create({ model: MODEL, input: "Another.", previous_response_id: first.id, max_output_tokens: 8 })
      .withResponse();
    const fetched = await client.responses.retrieve(follow.id);
    let unknown = null;
    try {
      await client.responses.retrieve("resp_" + "0".repeat(32));
    } catch (err) {
      unknown = errorShape(err);
    }
    return {
      first: { id: first.id, text: first.output_text, usage: first.usage, backend: response.headers.get("x-specroute-backend") },
      stream: { events, text, lastText: last?.output?.[0]?.content?.[0]?.text ?? null, usage: last?.usage ?? null },
      follow: {
        previous: follow.previous_response_id,
        usage: follow.usage,
        backend: followResponse.headers.get("x-specroute-backend"),
        reason: followResponse.headers.get("x-specroute-reason"),
      },
      fetched: { id: fetched.id, text: fetched.output_text },
      unknown,
    };
  },
};

const run = scenarios[scenario];
if (!run) {
  console.error(`unknown scenario ${scenario}; known: ${Object.keys(scenarios).join(", ")}`);
  process.exit(2);
}
try {
  const result = await run();
  process.stdout.write(JSON.stringify(result) + "\n");
  if (result.holdOpen) {
    // Hold the process (and its connection pool) until the test closes our stdin.
    while ((await stdinLine()) !== null);
  }
  process.exit(0);
} catch (err) {
  process.stdout.write(JSON.stringify({ error: errorShape(err), stack: err?.stack ?? null }) + "\n");
  process.exit(1);
}
