// The chat page: the open conversation and its replies, the composer (Enter sends, Esc stops),
// attached files, settings whose defaults come from /props, the context meter, and the API key.
import {apiKey, getJson} from "./api.js";
import {describe, streamReply} from "./chat.js";
import {askKey, initKeyDialog} from "./key.js";
import {initSidebar, renderList} from "./sidebar.js";
import * as store from "./store.js";
import {$, editorNode, el, fillReply, messageNode, noticeNode} from "./view.js";
const MAX_FILE = 1 << 20;  // bytes of one attached file, which goes into the prompt whole

const state = {
  conversations: store.loadConversations(),
  current: null,      // the open conversation (null: a new one, made when its first message is sent)
  settings: store.loadSettings(),
  nCtx: 0,
  running: null,      // {controller, conversation, reply} while a reply streams
  attachments: [],    // [{name, text}] for the next message
  notice: null,       // {id, text}: an error shown under conversation id (null: any)
};

function save() {
  if (!store.saveConversations(state.conversations)) {
    state.notice = {id: null, text: "The browser's storage is full: export and delete old conversations."};
  }
}

function showNotice(text) {
  state.notice = {id: state.current?.id ?? null, text};
  renderConversation();
}

// ---- the open conversation

function nearBottom(box) {
  return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
}

function renderConversation() {
  const box = $("messages");
  const conversation = state.current;
  const busy = state.running !== null;
  $("title").textContent = conversation ? conversation.title : store.UNTITLED;
  const messages = conversation ? conversation.messages : [];
  const nodes = messages.map((m, i) => messageNode(m, i, i === messages.length - 1, busy));
  if (!messages.length) nodes.push(el("p", "empty muted", "Ask anything. Enter sends; Shift+Enter starts a new line."));
  if (state.notice && (state.notice.id === null || state.notice.id === conversation?.id)) {
    nodes.push(noticeNode(state.notice.text));
  }
  box.replaceChildren(...nodes);
  box.scrollTop = box.scrollHeight;
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  updateMeter();
}

function updateMeter() {
  const stats = state.current?.messages.findLast((m) => m.stats?.context)?.stats;
  const used = stats ? stats.context : 0;
  const meter = $("context");
  meter.hidden = !state.nCtx;
  meter.max = state.nCtx || 1;
  meter.value = Math.min(used, state.nCtx || 1);
  $("context-text").textContent = state.nCtx ? `${used} / ${state.nCtx}` : "";
  meter.title = `${used} of the model's ${state.nCtx} tokens of context`;
}

function openConversation(id) {
  state.current = state.conversations.find((c) => c.id === id) || null;
  store.saveCurrent(state.current?.id);
  document.body.classList.remove("sidebar-open");
  renderConversation();
  renderList(state);
}

function removeConversation(id) {
  if (state.running?.conversation.id === id) state.running.controller.abort();
  state.conversations = state.conversations.filter((c) => c.id !== id);
  save();
  if (state.current?.id === id) openConversation(null);
  else renderList(state);
}

// ---- sending and streaming

function titleOf(text, files) {
  const line = text.trim().split("\n")[0] || files?.[0]?.name || store.UNTITLED;
  return line.length > 48 ? `${line.slice(0, 47)}…` : line;
}

function send() {
  const input = $("input");
  const text = input.value;
  if (state.running || (!text.trim() && !state.attachments.length)) return;
  if (!state.current) {
    const now = Date.now();
    state.current = {id: store.newId(), title: store.UNTITLED, created: now, updated: now, messages: []};
    state.conversations.unshift(state.current);
    store.saveCurrent(state.current.id);
  }
  const message = {role: "user", content: text};
  if (state.attachments.length) message.files = state.attachments;
  input.value = "";
  state.attachments = [];
  store.saveDraft("");
  renderAttachments();
  ask(state.current, message);
}

// Sends message (a user message: new, or edited) at the end of the conversation and streams the reply.
function ask(conversation, message) {
  conversation.messages.push(message);
  if (conversation.title === store.UNTITLED) conversation.title = titleOf(message.content, message.files);
  generate(conversation, message);
}

// Puts a message that could not be sent back into the composer, before anything typed since.
function restore(message) {
  const input = $("input");
  input.value = input.value ? `${message.content}\n\n${input.value}` : message.content;
  store.saveDraft(input.value);
  state.attachments = [...(message.files || []), ...state.attachments];
  renderAttachments();
}

async function generate(conversation, asked) {
  const reply = {role: "assistant", content: ""};
  const history = conversation.messages.slice();
  conversation.messages.push(reply);
  conversation.updated = Date.now();
  state.conversations = [conversation, ...state.conversations.filter((c) => c !== conversation)];
  const controller = new AbortController();
  state.running = {controller, conversation, reply};
  state.notice = null;
  save();
  renderConversation();
  renderList(state);
  let frame = 0;
  let saved = performance.now();
  const paint = () => {
    frame = 0;
    const box = $("messages");
    const node = state.current === conversation && box.querySelector(`article[data-index="${history.length}"]`);
    if (!node) return;
    const follow = nearBottom(box);
    fillReply(node, reply, true);
    if (follow) box.scrollTop = box.scrollHeight;
  };
  try {
    await streamReply(history, state.settings, reply, controller.signal, () => {
      frame ||= requestAnimationFrame(paint);
      if (performance.now() - saved > 1000) {
        save();
        saved = performance.now();
      }
    });
  } catch (e) {
    if (e.name === "AbortError") reply.stopped = true;
    else if (reply.content || reply.reasoning) reply.error = describe(e);
    else {
      conversation.messages.splice(history.length - (asked ? 1 : 0));
      if (asked) restore(asked);
      if (!conversation.messages.length) {  // (it stays open, out of the list until a message is sent)
        conversation.title = store.UNTITLED;
        state.conversations = state.conversations.filter((c) => c !== conversation);
      }
      state.notice = {id: conversation.id, text: describe(e)};
      if (e.status === 401) askKey(e.message);
    }
  } finally {
    cancelAnimationFrame(frame);
    state.running = null;
    save();
    if (state.current === conversation) renderConversation();
    renderList(state);
  }
}

function stop() {
  state.running?.controller.abort();
}

// ---- the messages' buttons

async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // (no clipboard API outside a secure context: the old way, through a selection)
    const area = el("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => (button.textContent = label), 1200);
}

function onMessagesClick(event) {
  const button = event.target.closest("button");
  if (!button || !state.current) return;
  const conversation = state.current;
  if (button.dataset.copy === "code") {
    return copy(button.closest(".code-block").querySelector("code").textContent, button);
  }
  const index = Number(button.dataset.index);
  const message = conversation.messages[index];
  const action = button.dataset.action;
  if (action === "copy") copy(message.content, button);
  if (state.running) return;
  if (action === "regenerate") {
    conversation.messages.splice(index);
    generate(conversation, null);
  } else if (action === "edit") {
    const node = button.closest("article");
    const editor = editorNode(message, index);
    node.querySelector(".bubble").replaceWith(editor);
    node.querySelector(".actions").hidden = true;
    editor.querySelector("textarea").focus();
  } else if (action === "edit-cancel") {
    renderConversation();
  } else if (action === "edit-send") {
    const text = button.closest(".editor").querySelector("textarea").value;
    if (!text.trim() && !message.files?.length) return;
    conversation.messages.splice(index);
    ask(conversation, {...message, content: text});
  }
}

// ---- attachments

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren(...state.attachments.map((f, i) => {
    const chip = el("span", "file-chip", f.name);
    const remove = el("button", "small", "✕");
    remove.type = "button";
    remove.dataset.remove = String(i);
    remove.title = `Remove ${f.name}`;
    chip.append(remove);
    return chip;
  }));
}

async function attach(files) {
  for (const file of files) {
    if (file.size > MAX_FILE) {
      showNotice(`${file.name} is larger than ${MAX_FILE >> 20} MiB: attach a smaller text file.`);
      continue;
    }
    const text = await file.text();
    if (text.includes("\u0000")) showNotice(`${file.name} is not a text file.`);
    else state.attachments.push({name: file.name, text});
  }
  renderAttachments();
}

// ---- settings and the server

function renderSettings(defaults) {
  for (const input of document.querySelectorAll("[data-setting]")) {
    const key = input.dataset.setting;
    input.value = state.settings[key] ?? "";
    let shown = defaults[key];
    if (key === "max_tokens") shown = defaults.n_predict > 0 ? defaults.n_predict : "up to the context";
    if (key === "seed" && shown === -1) shown = "random";
    if (shown !== undefined) input.placeholder = String(shown);
  }
}

async function loadServer() {
  try {
    const props = await getJson("/props");
    const settings = props.default_generation_settings || {};
    state.nCtx = settings.n_ctx || 0;
    renderSettings(settings.params || {});
    const models = await getJson("/v1/models");
    $("model").textContent = models.data?.[0]?.id || "";
    updateMeter();
  } catch (e) {
    if (e.status === 401) {
      await askKey(apiKey.get() ? e.message : "");
      return loadServer();
    }
    $("model").textContent = e.status === 503 ? "loading the model…" : `server: ${e.message}`;
    setTimeout(loadServer, e.status === 503 ? 1000 : 3000);
  }
}

// ---- wiring

function init() {
  const input = $("input");
  input.value = store.loadDraft();
  input.addEventListener("input", () => store.saveDraft(input.value));
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.running) stop();
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.target.closest?.(".editor")) {
      e.preventDefault();
      e.target.closest(".editor").querySelector("[data-action=edit-send]").click();
    }
  });
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", stop);
  $("messages").addEventListener("click", onMessagesClick);
  $("attach").addEventListener("click", () => $("attach-file").click());
  $("attach-file").addEventListener("change", async (e) => {
    await attach(e.target.files);
    e.target.value = "";
  });
  $("attachments").addEventListener("click", (e) => {
    const index = e.target.dataset?.remove;
    if (index === undefined) return;
    state.attachments.splice(Number(index), 1);
    renderAttachments();
  });
  $("open-settings").addEventListener("click", () => ($("settings").hidden = !$("settings").hidden));
  $("settings").addEventListener("input", (e) => {
    const key = e.target.dataset.setting;
    if (!key) return;
    state.settings[key] = e.target.value;
    store.saveSettings(state.settings);
  });
  $("reset-settings").addEventListener("click", () => {
    state.settings = {};
    store.saveSettings(state.settings);
    for (const field of document.querySelectorAll("[data-setting]")) field.value = "";
  });
  $("open-sidebar").addEventListener("click", () => document.body.classList.add("sidebar-open"));
  $("close-sidebar").addEventListener("click", () => document.body.classList.remove("sidebar-open"));
  initKeyDialog();
  initSidebar(state, {open: openConversation, remove: removeConversation, save, notice: showNotice});
  openConversation(store.loadCurrent());
  renderSettings({});
  loadServer();
  input.focus();
}

init();
