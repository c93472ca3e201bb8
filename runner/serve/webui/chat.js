// One reply streamed into a conversation: the messages sent (system prompt, attached files), the
// sampling settings, the reply's text and thinking as they come, its figures, and what an error or
// a stop leaves behind.
import {ApiError, chatStream} from "./api.js";

const NUMERIC = ["temperature", "top_k", "top_p", "min_p", "max_tokens", "seed"];

// A fence longer than any run of backticks in text, so a file's contents cannot close it.
function fence(text) {
  const longest = Math.max(0, ...Array.from(text.matchAll(/`+/g), (m) => m[0].length));
  return "`".repeat(Math.max(3, longest + 1));
}

// A user message as the model reads it: its attached files first, each fenced, then what was typed.
function withFiles(message) {
  const files = (message.files || []).map((f) => `${f.name}:\n${fence(f.text)}\n${f.text}\n${fence(f.text)}`);
  return [...files, message.content].filter(Boolean).join("\n\n");
}

function apiMessages(messages, settings) {
  const out = [];
  if ((settings.system || "").trim()) out.push({role: "system", content: settings.system});
  for (const m of messages) {
    if (m.role === "user") out.push({role: "user", content: withFiles(m)});
    else if (m.content) out.push({role: "assistant", content: m.content});
  }
  return out;
}

// The sampling fields a person set (the server's defaults stand for the rest).
function samplingFields(settings) {
  const out = {};
  for (const key of NUMERIC) {
    const value = settings[key];
    if (value !== undefined && value !== "" && Number.isFinite(Number(value))) out[key] = Number(value);
  }
  return out;
}

// A reply's figures from the stream's usage and llama-server's timings, or from the page's clock
// where the server sent no timings.
function figures(started, first, ended, usage, timings) {
  const out = {};
  const tokens = usage?.completion_tokens ?? timings?.predicted_n;
  if (tokens !== undefined) out.tokens = tokens;
  if (first === undefined) return out;
  out.ttft = (first - started) / 1000;
  const prefilled = usage ? usage.prompt_tokens - (usage.prompt_tokens_details?.cached_tokens || 0) : 0;
  const promptRate = timings?.prompt_per_second || (prefilled && out.ttft ? prefilled / out.ttft : 0);
  const decoding = (ended - first) / 1000;
  const decodeRate = timings?.predicted_per_second || (tokens > 1 && decoding > 0 ? (tokens - 1) / decoding : 0);
  if (promptRate) out.promptRate = promptRate;
  if (decodeRate) out.decodeRate = decodeRate;
  if (usage) out.context = usage.prompt_tokens + usage.completion_tokens;
  return out;
}

// Streams the reply to the conversation's messages into reply (an assistant message already at the
// end of them), calling changed() as it grows; resolves once it is whole, throws as the stream does
// (an AbortError where stopped).
export async function streamReply(messages, settings, reply, signal, changed) {
  const body = {messages: apiMessages(messages, settings), stream: true, stream_options: {include_usage: true},
    ...samplingFields(settings)};
  const started = performance.now();
  let first, usage, timings;
  for await (const chunk of chatStream(body, signal)) {
    const delta = chunk.choices?.[0]?.delta || {};
    if (delta.content || delta.reasoning_content) {
      first ??= performance.now();
      reply.content += delta.content || "";
      if (delta.reasoning_content) reply.reasoning = (reply.reasoning || "") + delta.reasoning_content;
      changed();
    }
    timings = chunk.timings || timings;
    usage = chunk.usage || usage;
  }
  reply.stats = figures(started, first, performance.now(), usage, timings);
}

// What a failed request says in the conversation.
export function describe(error) {
  if (!(error instanceof ApiError)) return `The reply could not be read: ${error.message}`;
  const prefix = {0: "", 400: "The server refused the message: ", 401: "Wrong or missing API key: ",
    503: "The server is busy: "}[error.status] ?? `Error ${error.status}: `;
  return prefix + error.message;
}
