// The API key, asked for once in a dialog where the server answers 401, and kept in sessionStorage
// (api.js), so it lasts as long as the browser session and no longer.
import {apiKey} from "./api.js";
import {$} from "./view.js";
let waiting = [];  // the resolve functions of those who wait for a key

function submit() {
  const key = $("key-input").value.trim();
  if (!key) return;
  apiKey.set(key);
  $("key-dialog").close();
  const resolves = waiting;
  waiting = [];
  resolves.forEach((resolve) => resolve());
}

// Resolves once a key is given; refused: why the server refused the last one.
export function askKey(refused) {
  const dialog = $("key-dialog");
  $("key-error").textContent = refused ? `The server refused that key: ${refused}` : "";
  $("key-error").hidden = !refused;
  if (!dialog.open) {
    $("key-input").value = "";
    dialog.showModal();
  }
  return new Promise((resolve) => waiting.push(resolve));
}

export function initKeyDialog() {
  $("key-ok").addEventListener("click", submit);
  $("key-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter") {
      e.preventDefault();
      submit();
    }
  });
  $("key-dialog").addEventListener("cancel", (e) => e.preventDefault());  // (the page can do nothing without it)
}
