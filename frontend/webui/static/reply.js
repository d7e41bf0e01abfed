// One assistant reply as it streams in: its text, reasoning and tool calls added up from the chunks' deltas, and
// drawn into its <article> (the text as sanitized Markdown, reasoning folded, tool calls as blocks).

/* global marked, DOMPurify */

const RENDER_EVERY_MS = 60; // re-render the Markdown at most this often while tokens arrive

/** The model's Markdown as safe HTML: marked renders it, DOMPurify removes whatever could run or escape. */
export function markdownHtml(text) {
  return DOMPurify.sanitize(marked.parse(text, { gfm: true, breaks: false }));
}

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

/** The arguments of a tool call, indented when they are JSON (they may be cut short by a stop). */
function prettyArguments(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    return text;
  }
}

export class Reply {
  /** Draws an empty assistant turn at the end of `log`. */
  constructor(log) {
    this.content = "";
    this.reasoning = "";
    this.toolCalls = []; // by the delta's index: {id, name, arguments}
    this.finishReason = null;
    this.usage = null;
    this.article = el("article", "msg assistant streaming");
    this.article.setAttribute("aria-label", "Assistant");
    this.article.append(el("div", "role", "Assistant"));
    this.details = el("details", "reasoning");
    this.details.hidden = true;
    this.summary = el("summary", null, "Thinking…");
    this.reasoningText = el("div", "reasoning-text");
    this.details.append(this.summary, this.reasoningText);
    this.body = el("div", "content markdown");
    this.tools = el("div", "tool-calls");
    this.tools.hidden = true;
    this.meta = el("div", "meta");
    this.article.append(this.details, this.body, this.tools, this.meta);
    log.append(this.article);
    this.timer = null;
  }

  /** Adds one chunk of the stream (choice 0; the page asks for one). */
  add(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    if (!choice) return;
    const delta = choice.delta || {};
    // vLLM names it reasoning_content (and, newer, reasoning); both are the same text
    const reasoning = delta.reasoning_content ?? delta.reasoning;
    if (reasoning) this.reasoning += reasoning;
    if (delta.content) this.content += delta.content;
    for (const call of delta.tool_calls || []) {
      const i = call.index ?? this.toolCalls.length;
      const known = (this.toolCalls[i] ||= { id: "", name: "", arguments: "" });
      if (call.id) known.id = call.id;
      if (call.function?.name && !known.name) known.name = call.function.name; // sent once, in the first delta
      if (call.function?.arguments) known.arguments += call.function.arguments;
    }
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    this.scheduleRender();
  }

  scheduleRender() {
    this.timer ??= setTimeout(() => {
      this.timer = null;
      this.render();
    }, RENDER_EVERY_MS);
  }

  render() {
    if (this.reasoning) {
      this.details.hidden = false;
      this.reasoningText.textContent = this.reasoning;
      if (this.content || this.toolCalls.length || this.finished) this.summary.textContent = "Reasoning";
    }
    this.body.innerHTML = markdownHtml(this.content);
    this.tools.hidden = this.toolCalls.length === 0;
    this.tools.replaceChildren(...this.toolCalls.filter(Boolean).map((call) => {
      const block = el("div", "tool-call");
      block.append(el("div", "tool-name", `tool call: ${call.name}`), el("pre", "tool-arguments"));
      block.lastChild.append(el("code", null, prettyArguments(call.arguments)));
      return block;
    }));
  }

  /** The last render, and the line under the reply: why it ended and how fast it came. */
  finish(note, seconds) {
    clearTimeout(this.timer);
    this.timer = null;
    this.finished = true;
    this.render();
    this.article.classList.remove("streaming");
    const parts = [];
    if (note) parts.push(note);
    else if (this.finishReason === "length") parts.push("cut at max tokens");
    else if (this.finishReason && this.finishReason !== "stop") parts.push(`finish: ${this.finishReason}`);
    const tokens = this.usage?.completion_tokens;
    if (tokens) parts.push(`${tokens} tokens` + (seconds > 0 ? `, ${(tokens / seconds).toFixed(1)} tok/s` : ""));
    this.meta.textContent = parts.join(" · ");
    this.addCopyButtons();
  }

  addCopyButtons() {
    if (!navigator.clipboard) return; // only in a secure context (https, or localhost)
    for (const pre of this.body.querySelectorAll("pre")) {
      const button = el("button", "copy", "Copy");
      button.type = "button";
      button.setAttribute("aria-label", "Copy code");
      button.addEventListener("click", async () => {
        await navigator.clipboard.writeText(pre.querySelector("code")?.textContent ?? pre.textContent);
        button.textContent = "Copied";
      });
      pre.prepend(button);
    }
  }

  /** The assistant message the history keeps: its text (reasoning is not sent back, as OpenAI advises). */
  message() {
    return { role: "assistant", content: this.content };
  }
}
