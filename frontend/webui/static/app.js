// The chat page: settings, the conversation (kept in the page; New chat clears it), send and stop.

import { ApiError, listModels, streamChat } from "./api.js";
import { Reply } from "./reply.js";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), newChat: $("new-chat"), system: $("system"), temperature: $("temperature"), topP: $("top-p"),
  maxTokens: $("max-tokens"), tools: $("tools"), apiKey: $("api-key"), error: $("error"),
  errorText: $("error-text"), errorClose: $("error-close"), log: $("log"), composer: $("composer"),
  prompt: $("prompt"), send: $("send"), stop: $("stop"), status: $("status"),
};

// Settings outlive a reload (localStorage); the API key only the tab's session (sessionStorage).
const SAVED = ["system", "temperature", "topP", "maxTokens", "tools"];
for (const name of SAVED) {
  ui[name].value = localStorage.getItem(`llm-engine.${name}`) ?? "";
  ui[name].addEventListener("change", () => localStorage.setItem(`llm-engine.${name}`, ui[name].value));
}
ui.apiKey.value = sessionStorage.getItem("llm-engine.apiKey") ?? "";

let history = []; // the conversation as the API takes it: user and assistant messages (the system prompt apart)
let running = null; // the AbortController of the reply streaming now

function showError(message) {
  ui.errorText.textContent = message;
  ui.error.hidden = false;
}

function clearError() {
  ui.error.hidden = true;
  ui.errorText.textContent = "";
}

function setRunning(controller) {
  running = controller;
  ui.send.disabled = controller !== null;
  ui.stop.disabled = controller === null;
  ui.status.textContent = controller ? "Generating…" : "";
}

async function loadModels() {
  try {
    const ids = await listModels(ui.apiKey.value.trim());
    ui.model.replaceChildren(...ids.map((id) => new Option(id, id)));
    clearError();
  } catch (e) {
    ui.model.replaceChildren(new Option("(unavailable)", ""));
    showError(`Could not list the models: ${e.message}`);
  }
}

/** The request's sampling fields: an empty box leaves the server's default. */
function samplingFields() {
  const out = {};
  for (const [field, input] of [["temperature", ui.temperature], ["top_p", ui.topP], ["max_tokens", ui.maxTokens]]) {
    if (input.value.trim() !== "") out[field] = Number(input.value);
  }
  const tools = ui.tools.value.trim();
  if (tools) {
    try {
      out.tools = JSON.parse(tools);
    } catch (e) {
      throw new ApiError(`the Tools box is not valid JSON: ${e.message}`);
    }
  }
  return out;
}

function userTurn(text) {
  const article = document.createElement("article");
  article.className = "msg user";
  article.setAttribute("aria-label", "You");
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = "You";
  const body = document.createElement("div");
  body.className = "content";
  body.textContent = text; // the user's own words, shown as typed
  article.append(role, body);
  ui.log.append(article);
  return article;
}

async function send(text) {
  clearError();
  const system = ui.system.value.trim();
  const user = { role: "user", content: text };
  const conversation = history; // New chat during this reply starts another; this one's end stays here
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...conversation, user];
  let fields;
  try {
    fields = samplingFields();
  } catch (e) {
    showError(e.message);
    return;
  }
  ui.prompt.value = "";
  const question = userTurn(text);
  const reply = new Reply(ui.log);
  reply.article.scrollIntoView({ block: "end" });
  const controller = new AbortController();
  setRunning(controller);
  const body = { model: ui.model.value || undefined, messages, stream: true,
                 stream_options: { include_usage: true }, ...fields };
  const started = performance.now();
  try {
    for await (const chunk of streamChat(body, ui.apiKey.value.trim(), controller.signal)) {
      reply.add(chunk);
      if (ui.log.scrollHeight - ui.log.scrollTop - ui.log.clientHeight < 80) reply.article.scrollIntoView(false);
    }
    reply.finish(null, (performance.now() - started) / 1000);
    conversation.push(user, reply.message());
  } catch (e) {
    if (e.name === "AbortError") {
      reply.finish("stopped", 0); // the partial answer stays, and in the history too
      conversation.push(user, reply.message());
    } else {
      // a failed exchange is not part of the conversation: dimmed, and the text back in the box to try again
      reply.finish("failed", 0);
      question.classList.add("failed");
      reply.article.classList.add("failed");
      if (!ui.prompt.value) ui.prompt.value = text;
      showError(e instanceof ApiError ? e.message : `${e.name}: ${e.message}`);
    }
  } finally {
    if (running === controller) setRunning(null);
  }
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.prompt.value.trim();
  if (text && !running) send(text);
});

ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    ui.composer.requestSubmit();
  } else if (event.key === "Escape" && running) {
    running.abort();
  }
});

ui.stop.addEventListener("click", () => running?.abort());

ui.newChat.addEventListener("click", () => {
  running?.abort();
  history = [];
  ui.log.replaceChildren();
  clearError();
  ui.prompt.focus();
});

ui.apiKey.addEventListener("change", () => {
  sessionStorage.setItem("llm-engine.apiKey", ui.apiKey.value.trim());
  loadModels();
});

ui.errorClose.addEventListener("click", clearError);

loadModels();
ui.prompt.focus();
