// What the page keeps in the browser (localStorage): the conversations, the settings, which
// conversation is open and the unsent message. Imported files are untrusted: only known fields of
// the right types come through.

const CONVERSATIONS = "ggrun.conversations";
const SETTINGS = "ggrun.settings";
const CURRENT = "ggrun.current";
const DRAFT = "ggrun.draft";
const EXPORT_FORMAT = "ggrun-conversations";
export const UNTITLED = "New chat";

function read(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value === null ? fallback : value;
  } catch {
    return fallback;
  }
}

// Writes value; false where the browser refuses (storage full or off).
function write(key, value) {
  try {
    localStorage.setItem(key, typeof value === "string" ? value : JSON.stringify(value));
    return true;
  } catch {
    return false;
  }
}

export function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

const text = (value) => (typeof value === "string" ? value : "");
const number = (value) => (typeof value === "number" && Number.isFinite(value) ? value : undefined);

function cleanStats(stats) {
  if (!stats || typeof stats !== "object") return undefined;
  const out = {};
  for (const key of ["tokens", "ttft", "promptRate", "decodeRate", "context"]) {
    if (number(stats[key]) !== undefined) out[key] = stats[key];
  }
  return out;
}

function cleanMessage(m) {
  if (!m || typeof m !== "object" || !["user", "assistant"].includes(m.role)) return null;
  const out = {role: m.role, content: text(m.content)};
  if (m.role === "user" && Array.isArray(m.files)) {
    const files = m.files.filter((f) => f && typeof f === "object");
    out.files = files.map((f) => ({name: text(f.name), text: text(f.text)}));
  }
  if (m.role === "assistant") {
    if (text(m.reasoning)) out.reasoning = m.reasoning;
    const stats = cleanStats(m.stats);
    if (stats) out.stats = stats;
    if (m.stopped === true) out.stopped = true;
    if (text(m.error)) out.error = m.error;
  }
  return out;
}

function cleanConversation(c) {
  if (!c || typeof c !== "object" || !Array.isArray(c.messages)) return null;
  const now = Date.now();
  return {
    id: typeof c.id === "string" && /^[\w-]{1,64}$/.test(c.id) ? c.id : newId(),
    title: text(c.title).slice(0, 200) || UNTITLED,
    created: number(c.created) ?? now,
    updated: number(c.updated) ?? now,
    messages: c.messages.map(cleanMessage).filter(Boolean),
  };
}

export function loadConversations() {
  const stored = read(CONVERSATIONS, []);
  return Array.isArray(stored) ? stored.map(cleanConversation).filter(Boolean) : [];
}

export const saveConversations = (conversations) => write(CONVERSATIONS, conversations);
export const loadSettings = () => read(SETTINGS, {});
export const saveSettings = (settings) => write(SETTINGS, settings);
export const loadCurrent = () => localStorage.getItem(CURRENT);
export const saveCurrent = (id) => write(CURRENT, id || "");
export const loadDraft = () => localStorage.getItem(DRAFT) || "";
export const saveDraft = (draft) => write(DRAFT, draft);

export function exportJson(conversations) {
  return JSON.stringify({format: EXPORT_FORMAT, version: 1, conversations}, null, 2);
}

// The conversations a file holds (an export, a list of conversations or one), cleaned; throws
// an Error saying why where there are none.
export function importJson(source) {
  let data;
  try {
    data = JSON.parse(source);
  } catch {
    throw new Error("the file is not JSON");
  }
  const list = Array.isArray(data) ? data : Array.isArray(data?.conversations) ? data.conversations : [data];
  const found = list.map(cleanConversation).filter(Boolean);
  if (!found.length) throw new Error("the file holds no conversation");
  return found;
}
