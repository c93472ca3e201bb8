// The server's public API, called as any OpenAI client calls it: the API key (kept for this browser
// session only), errors as ApiError with the server's message, and a chat reply's stream of chunks.

const KEY = "ggrun.key";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;  // (0: the server could not be reached)
  }
}

export const apiKey = {
  get: () => sessionStorage.getItem(KEY) || "",
  set: (key) => sessionStorage.setItem(KEY, key),
};

function headers() {
  const key = apiKey.get();
  const json = {"Content-Type": "application/json"};
  return key ? {...json, Authorization: `Bearer ${key}`} : json;
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    const error = body?.error;
    if (error) message = typeof error === "string" ? error : String(error.message || message);
  } catch {
    // (not JSON: the status line says what happened)
  }
  return new ApiError(response.status, message);
}

async function call(path, init) {
  let response;
  try {
    response = await fetch(path, {...init, headers: headers()});
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, "the server cannot be reached");
  }
  if (!response.ok) throw await failure(response);
  return response;
}

export async function getJson(path) {
  return (await call(path, {})).json();
}

// The chunks of a streamed chat completion (server-sent events), until [DONE]; an error event
// the server sends after the reply began is thrown as an ApiError.
export async function* chatStream(body, signal) {
  const response = await call("/v1/chat/completions", {method: "POST", body: JSON.stringify(body), signal});
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let part;
    try {
      part = await reader.read();
    } catch (e) {
      if (e.name === "AbortError") throw e;
      throw new ApiError(0, "the connection to the server was lost");
    }
    if (part.done) return;
    buffer += decoder.decode(part.value, {stream: true});
    for (let end; (end = buffer.indexOf("\n\n")) >= 0; ) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") return;
        const chunk = JSON.parse(line.slice(6));
        if (chunk.error) throw new ApiError(chunk.error.code || 500, chunk.error.message || "the server failed");
        yield chunk;
      }
    }
  }
}
