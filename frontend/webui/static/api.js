// The OpenAI-compatible API as the page uses it: /v1/models and streamed /v1/chat/completions (SSE over fetch).

/** An error the server (or the network) gave, with the readable message the page shows. */
export class ApiError extends Error {
  constructor(message, status = null) {
    super(message);
    this.name = "ApiError";
    this.status = status;
  }
}

// Relative URLs: the page works the same behind a reverse proxy that mounts the server under a prefix.
const MODELS = "v1/models";
const CHAT = "v1/chat/completions";

function headers(apiKey) {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h.Authorization = `Bearer ${apiKey}`;
  return h;
}

/** The message of an OpenAI error body ({"error": {"message": ...}}), else the body's text, else the status. */
async function errorOf(response) {
  const text = await response.text().catch(() => "");
  let message = text.trim();
  try {
    const body = JSON.parse(text);
    message = body?.error?.message || body?.message || message;
  } catch {
    // not JSON (a proxy's HTML page, say): its text is all there is
  }
  return new ApiError(`${response.status} ${response.statusText || ""}`.trim() + (message ? `: ${message}` : ""),
                      response.status);
}

async function send(url, init) {
  try {
    return await fetch(url, init);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(`cannot reach the server: ${e.message}`);
  }
}

/** The ids of the models the server serves. */
export async function listModels(apiKey) {
  const r = await send(MODELS, { headers: headers(apiKey) });
  if (!r.ok) throw await errorOf(r);
  const body = await r.json();
  return (body.data || []).map((m) => m.id);
}

/**
 * The data fields of a server-sent event stream, one string an event (the SSE rules: events end at a blank line,
 * lines end in \n, \r\n or \r, several data lines join with \n, comments start with ':').
 */
export async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      // a \r at the end may be the first half of \r\n: keep it for the next read
      const lines = buffer.split(/\r\n|\n|\r(?!$)/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line === "") {
          if (data.length) yield data.join("\n");
          data = [];
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line[5] === " " ? 6 : 5));
        }
      }
    }
    if (buffer.startsWith("data:")) data.push(buffer.slice(buffer[5] === " " ? 6 : 5));
    if (data.length) yield data.join("\n");
  } finally {
    reader.releaseLock();
  }
}

/**
 * Streams one chat completion: yields each chunk object until [DONE]. `signal` aborts it (the server then aborts
 * the request: it sees the stream close). An error event in the stream is thrown as an ApiError.
 */
export async function* streamChat(body, apiKey, signal) {
  const r = await send(CHAT, { method: "POST", headers: headers(apiKey), body: JSON.stringify(body), signal });
  if (!r.ok) throw await errorOf(r);
  for await (const data of sseData(r.body)) {
    if (data === "[DONE]") return;
    let chunk;
    try {
      chunk = JSON.parse(data);
    } catch {
      throw new ApiError(`the server sent an event that is not JSON: ${data.slice(0, 200)}`);
    }
    if (chunk.error) throw new ApiError(chunk.error.message || JSON.stringify(chunk.error)); // an error event
    yield chunk;
  }
  throw new ApiError("the stream ended without [DONE]: the server may have stopped");
}
