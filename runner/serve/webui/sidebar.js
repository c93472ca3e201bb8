// The list of conversations: search, open, rename, delete (a second click confirms), and export
// and import as JSON files.
import * as store from "./store.js";
import {$, conversationItem} from "./view.js";

function matches(conversation, query) {
  const q = query.toLowerCase();
  return !q || conversation.title.toLowerCase().includes(q)
    || conversation.messages.some((m) => m.content.toLowerCase().includes(q));
}

export function renderList(state) {
  const query = $("search").value.trim();
  const shown = state.conversations.filter((c) => matches(c, query));
  $("conversations").replaceChildren(...shown.map((c) => conversationItem(c, state.current?.id)));
}

function rename(state, item, actions) {
  const conversation = state.conversations.find((c) => c.id === item.dataset.id);
  const field = document.createElement("input");
  field.className = "rename";
  field.value = conversation.title;
  field.setAttribute("aria-label", "New title");
  item.querySelector(".conv-title").replaceWith(field);
  field.focus();
  field.select();
  let done = false;
  const finish = (keep) => {
    if (done) return;
    done = true;
    if (keep && field.value.trim()) {
      conversation.title = field.value.trim().slice(0, 200);
      actions.save();
    }
    renderList(state);
    if (state.current === conversation) $("title").textContent = conversation.title;
  };
  field.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    if (e.key === "Escape") {
      e.stopPropagation();
      finish(false);
    }
  });
  field.addEventListener("blur", () => finish(true));
}

function download(name, text) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([text], {type: "application/json"}));
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}

async function importFile(state, file, actions) {
  let found;
  try {
    found = store.importJson(await file.text());
  } catch (e) {
    actions.notice(`Could not import ${file.name}: ${e.message}.`);
    return;
  }
  const ids = new Set(found.map((c) => c.id));
  state.conversations = [...found, ...state.conversations.filter((c) => !ids.has(c.id))];
  actions.save();
  actions.open(found[0].id);
}

// actions: open(id), remove(id), save(), notice(text).
export function initSidebar(state, actions) {
  $("search").addEventListener("input", () => renderList(state));
  $("new-chat").addEventListener("click", () => {
    actions.open(null);
    $("input").focus();
  });
  $("conversations").addEventListener("click", (e) => {
    const button = e.target.closest("button");
    const item = e.target.closest("li");
    if (!button || !item) return;
    const action = button.dataset.action;
    if (action === "open") actions.open(item.dataset.id);
    if (action === "rename") rename(state, item, actions);
    if (action === "delete" && button.dataset.armed) actions.remove(item.dataset.id);
    if (action === "delete" && !button.dataset.armed) {
      button.dataset.armed = "1";
      button.textContent = "Delete?";
      button.classList.add("confirm");
      button.addEventListener("blur", () => renderList(state), {once: true});
    }
  });
  $("export").addEventListener("click", () => {
    download("ggrun-conversations.json", store.exportJson(state.conversations));
  });
  $("import").addEventListener("click", () => $("import-file").click());
  $("import-file").addEventListener("change", async (e) => {
    if (e.target.files[0]) await importFile(state, e.target.files[0], actions);
    e.target.value = "";
  });
}
