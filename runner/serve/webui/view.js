// The page's pieces as DOM nodes: a message (its text, thinking, figures, buttons), the editor of a
// user message, a notice, a conversation in the list. Buttons carry data-action for app.js.
import {renderMarkdown} from "./markdown.js";

export const $ = (id) => document.getElementById(id);

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, action, index, title) {
  const b = el("button", "small", label);
  b.type = "button";
  b.dataset.action = action;
  if (index !== undefined) b.dataset.index = String(index);
  if (title) b.title = title;
  return b;
}

const round = (x, digits) => (x >= 100 ? Math.round(x) : x.toFixed(digits));

// A reply's figures in one line: tokens, time to first token, prompt and decode speeds.
function figuresLine(stats) {
  const parts = [];
  if (stats.tokens !== undefined) parts.push(`${stats.tokens} tokens`);
  if (stats.ttft !== undefined) parts.push(`first token ${round(stats.ttft, 2)} s`);
  if (stats.promptRate) parts.push(`prompt ${round(stats.promptRate, 1)} tok/s`);
  if (stats.decodeRate) parts.push(`decode ${round(stats.decodeRate, 1)} tok/s`);
  return parts.join(" · ");
}

export function messageNode(message, index, last, busy) {
  const node = el("article", `msg ${message.role}`);
  node.dataset.index = String(index);
  const bubble = el("div", "bubble");
  node.append(bubble);
  const actions = el("div", "actions");
  if (message.role === "user") {
    for (const f of message.files || []) bubble.append(el("div", "file-chip", f.name));
    bubble.append(el("div", "plain", message.content));
    if (!busy) actions.append(button("Edit", "edit", index, "Edit and send again"));
  } else {
    fillReply(node, message, false);
    if (last && !busy) actions.append(button("Regenerate", "regenerate", index, "Ask for this reply again"));
  }
  actions.append(button("Copy", "copy", index, "Copy the message's text"));
  node.append(actions);
  return node;
}

// An assistant message's content into its node (again as it streams in).
export function fillReply(node, message, streaming) {
  const bubble = node.querySelector(".bubble");
  let thinking = bubble.querySelector("details.reasoning");
  if (message.reasoning && !thinking) {
    thinking = el("details", "reasoning");
    thinking.append(el("summary", "", "Thinking"), el("div", "md"));
    bubble.prepend(thinking);
  }
  if (thinking) {
    thinking.querySelector("summary").textContent = streaming && !message.content ? "Thinking…" : "Thinking";
    renderMarkdown(message.reasoning, thinking.querySelector(".md"));
  }
  let answer = bubble.querySelector(":scope > .md");
  if (!answer) bubble.append((answer = el("div", "md")));
  renderMarkdown(message.content, answer);
  answer.classList.toggle("streaming", streaming);
  for (const old of node.querySelectorAll(":scope > .figures, :scope > .error-text")) old.remove();
  const notes = [];
  if (message.stats) notes.push(el("div", "figures", figuresLine(message.stats)));
  if (message.stopped) notes.push(el("div", "figures", "stopped"));
  if (message.error) notes.push(el("div", "error-text", message.error));
  bubble.after(...notes);
}

// A user message's editor, in place of its bubble.
export function editorNode(message, index) {
  const box = el("div", "editor");
  const area = el("textarea");
  area.value = message.content;
  area.rows = Math.min(12, message.content.split("\n").length + 1);
  const buttons = el("div", "editor-buttons");
  buttons.append(button("Cancel", "edit-cancel", index), button("Send", "edit-send", index));
  buttons.lastChild.classList.add("primary");
  box.append(area, buttons);
  return box;
}

export function noticeNode(text) {
  return el("div", "notice error-text", text);
}

export function conversationItem(conversation, current) {
  const item = el("li", conversation.id === current ? "conv current" : "conv");
  item.dataset.id = conversation.id;
  const open = button(conversation.title, "open");
  open.classList.replace("small", "conv-title");
  item.append(open, button("✎", "rename", undefined, "Rename"), button("✕", "delete", undefined, "Delete"));
  return item;
}
