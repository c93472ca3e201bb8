// Markdown into DOM nodes. Text only ever lands in text nodes, so HTML in a model's reply (or in an
// imported conversation) shows as text and never runs; links keep http, https and mailto targets only.
import {highlight} from "./highlight.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:\s+|$)(.*)$/;
const TABLE_RULE = /^ {0,3}\|?\s*:?-+:?\s*(?:\|\s*:?-+:?\s*)*\|?\s*$/;
const SAFE_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

// The reply's blocks, in place of what the container held.
export function renderMarkdown(source, container) {
  container.replaceChildren(...blocks(source.replace(/\r\n?/g, "\n").split("\n")));
}

// A link's target where its protocol is one a page may follow; else null.
function safeUrl(text) {
  try {
    const url = new URL(text);
    return SAFE_PROTOCOLS.has(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function blocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      const close = new RegExp(`^ {0,3}${m[1][0] === "`" ? "`" : "~"}{${m[1].length},}\\s*$`);
      const body = [];
      for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
      i++;  // (past the closing fence; a streaming reply may not have written it yet)
      out.push(codeBlock(body.join("\n"), m[2]));
    } else if ((m = HEADING.exec(line))) {
      out.push(inline(m[2], el(`h${m[1].length}`)));
      i++;
    } else if (RULE.test(line)) {
      out.push(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i++) inner.push(lines[i].replace(QUOTE, ""));
      const quote = el("blockquote");
      quote.append(...blocks(inner));
      out.push(quote);
    } else if (ITEM.test(line)) {
      i = list(lines, i, out);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      i = table(lines, i, out);
    } else {
      const p = el("p");
      for (let first = true; i < lines.length && lines[i].trim() && (first || !startsBlock(lines[i])); i++) {
        if (!first) p.append(el("br"));
        inline(lines[i].trim(), p);
        first = false;
      }
      out.push(p);
    }
  }
  return out;
}

function codeBlock(code, language) {
  const box = el("div", "code-block");
  const head = el("div", "code-head");
  const name = el("span", "code-lang");
  name.textContent = language || "text";
  const copy = el("button", "copy");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.dataset.copy = "code";
  head.append(name, copy);
  const pre = el("pre");
  const body = el("code");
  body.append(...highlight(code, language));
  pre.append(body);
  box.append(head, pre);
  return box;
}

function indentOf(line) {
  return line.length - line.trimStart().length;
}

// A list from lines[i] on into out; returns the index past it. An item holds the lines indented
// under it (dedented, then read as blocks: nested lists, code) and lazy continuation lines.
function list(lines, i, out) {
  const first = ITEM.exec(lines[i]);
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  const base = first[1].length;
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || m[1].length > base + 1 || /\d/.test(m[2]) !== ordered) break;
    const inner = Math.min(m[1].length + m[2].length + 1, base + 2);
    const body = [m[3]];
    for (i++; i < lines.length; i++) {
      const line = lines[i];
      if (!line.trim()) {
        const next = lines.slice(i + 1).find((l) => l.trim());
        if (next === undefined || indentOf(next) < inner) break;
        body.push("");
      } else if (indentOf(line) >= inner) {
        body.push(line.slice(Math.min(indentOf(line), m[1].length + m[2].length + 1)));
      } else if (startsBlock(line)) {
        break;
      } else {
        body.push(line.trim());
      }
    }
    const item = el("li");
    item.append(...blocks(body));
    node.append(item);
    while (i < lines.length && !lines[i].trim() && ITEM.test(lines.slice(i).find((l) => l.trim()) || "")) i++;
  }
  out.push(node);
  return i;
}

function cells(line) {
  const cut = line.trim().replace(/^\|/, "").replace(/(?<!\\)\|$/, "");
  return cut.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(lines, i, out) {
  const aligns = cells(lines[i + 1]).map((c) => (c.endsWith(":") ? (c.startsWith(":") ? "center" : "right") : ""));
  const wrap = el("div", "table-wrap");
  const grid = el("table");
  const row = (line, tag) => {
    const tr = el("tr");
    cells(line).slice(0, aligns.length).forEach((text, k) => {
      tr.append(inline(text, el(tag, aligns[k] && `align-${aligns[k]}`)));
    });
    return tr;
  };
  const head = el("thead");
  head.append(row(lines[i], "th"));
  const body = el("tbody");
  for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) body.append(row(lines[i], "td"));
  grid.append(head, body);
  wrap.append(grid);
  out.push(wrap);
  return i;
}

// A span whose inner text (the match's group) is read again for spans of its own.
function wrapping(tag, group) {
  return (m, parent, links) => parent.append(inline(m[group], el(tag), links));
}

// Inline spans, tried where a special character stands (sticky patterns, matched at that place).
const SPANS = [
  [/\\([!-/:-@[-`{-~])/y, (m, parent) => parent.append(m[1])],
  [/(`+)(.+?)\1(?!`)/y, (m, parent) => {
    const code = el("code");
    code.textContent = /^ .* $/.test(m[2]) ? m[2].slice(1, -1) : m[2];
    parent.append(code);
  }],
  [/(!?)\[((?:[^[\]\\]|\\.)*)\]\(\s*<?((?:[^\s()<>]|\([^\s()<>]*\))*)>?(?:\s+"[^"]*")?\s*\)/y, (m, parent, links) => {
    const label = m[1] && !m[2] ? "image" : m[2];
    parent.append(link(m[3], label, links));
  }],
  [/<((?:https?|mailto):[^\s<>]+)>/y, (m, parent, links) => parent.append(link(m[1], m[1], links, true))],
  [/(?<![\w/])https?:\/\/[^\s<>]*[^\s<>.,;:!?'")\]*_~]/y, (m, parent, links) => {
    parent.append(link(m[0], m[0], links, true));
  }],
  [/(\*\*|__)(?=\S)([\s\S]*?\S)\1/y, wrapping("strong", 2)],
  [/\*(?=[^\s*])((?:\*\*[^*]+\*\*|[^*])*?[^\s*])\*/y, wrapping("em", 1)],
  [/(?<![A-Za-z0-9])_(?=\S)([^_]*?\S)_(?![A-Za-z0-9])/y, wrapping("em", 1)],  // (not inside snake_case words)
  [/~~(?=\S)([\s\S]*?\S)~~/y, wrapping("del", 1)],
];
const SPECIAL = /[\\`![<h*_~]/g;

// A link to target where it is safe, else its label alone (literal: the label is shown as written).
function link(target, label, links, literal = false) {
  const url = links ? safeUrl(target) : null;
  const node = url ? el("a") : el("span", "link-text");
  if (url) {
    node.href = url;
    node.target = "_blank";
    node.rel = "noopener noreferrer";
  }
  if (literal) node.textContent = label;
  return literal ? node : inline(label, node, false);
}

// text's spans appended to parent (links: whether links may be made, not inside another link).
function inline(text, parent, links = true) {
  let plain = 0;
  SPECIAL.lastIndex = 0;
  for (let m; (m = SPECIAL.exec(text)); ) {
    const at = m.index;
    for (const [pattern, make] of SPANS) {
      pattern.lastIndex = at;
      const found = pattern.exec(text);
      if (!found) continue;
      if (at > plain) parent.append(text.slice(plain, at));
      make(found, parent, links);
      plain = at + found[0].length;
      SPECIAL.lastIndex = plain;
      break;
    }
  }
  if (plain < text.length) parent.append(text.slice(plain));
  return parent;
}
