// Syntax highlighting for code blocks: a small tokenizer that gives comments, strings, numbers and
// keywords a class each; every piece lands in textContent, so code shows exactly as written.

const FAMILIES = {
  python: {comment: "#", words: `
    and as assert async await break class continue def del elif else except False finally for from
    global if import in is lambda None nonlocal not or pass raise return self True try while with
    yield match case`},
  js: {comment: "//", words: `
    async await break case catch class const continue debugger default delete do else export extends
    false finally for function if import in instanceof let new null of return static super switch
    this throw true try typeof undefined var void while with yield interface type enum implements
    private public protected readonly`},
  c: {comment: "//", words: `
    auto bool break case catch char class const constexpr continue default delete do double else
    enum extern false float for friend goto if inline int long namespace new nullptr operator
    private protected public return short signed sizeof static struct switch template this throw
    true try typedef typename union unsigned using virtual void volatile while import package
    extends implements final abstract boolean byte interface null super var val fun func go defer
    chan select range map string struct type nil`},
  rust: {comment: "//", words: `
    as async await break const continue crate dyn else enum extern false fn for if impl in let loop
    match mod move mut pub ref return self Self static struct super trait true type unsafe use where
    while Some None Ok Err`},
  shell: {comment: "#", words: `
    if then else elif fi for while until do done case esac in function return local export echo exit
    set unset readonly shift source`},
  sql: {comment: "--", words: `
    select from where and or not insert into values update set delete create table index view drop
    alter add primary key foreign references join left right inner outer on group by order having
    limit offset as distinct union all null is in like between case when then else end`},
};
const LANGUAGES = {
  python: "python", py: "python", js: "js", javascript: "js", ts: "js", typescript: "js", jsx: "js", tsx: "js",
  json: "js", c: "c", h: "c", cpp: "c", "c++": "c", cc: "c", hpp: "c", java: "c", cs: "c", csharp: "c", go: "c",
  kotlin: "c", swift: "c", rust: "rust", rs: "rust", sh: "shell", bash: "shell", shell: "shell", zsh: "shell",
  console: "shell", sql: "sql",
};
const COMMENTS = {"#": /#[^\n]*/.source, "//": /\/\/[^\n]*|\/\*[\s\S]*?(?:\*\/|$)/.source, "--": /--[^\n]*/.source};
// (an unclosed string or comment runs to the end: a streaming reply may not have closed it yet)
const STRINGS = [/"""[\s\S]*?(?:"""|$)/, /'''[\s\S]*?(?:'''|$)/, /"(?:[^"\\\n]|\\.)*"?/, /'(?:[^'\\\n]|\\.)*'?/,
  /`(?:[^`\\]|\\.)*`?/].map((r) => r.source).join("|");
const NUMBER = /\b(?:0[xX][\da-fA-F_]+|\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?)\b/.source;
const WORD = /[A-Za-z_$][\w$]*/.source;
const KINDS = ["com", "str", "num", "word"];

const compiled = new Map();

// A language family's pattern and keywords, compiled on first use.
function family(name) {
  if (!compiled.has(name)) {
    const f = FAMILIES[name];
    const pattern = [COMMENTS[f.comment], STRINGS, NUMBER, WORD].map((p) => `(${p})`).join("|");
    const words = f.words.trim().split(/\s+/);
    compiled.set(name, {pattern: new RegExp(pattern, "g"),
      words: new Set(name === "sql" ? [...words, ...words.map((w) => w.toUpperCase())] : words)});
  }
  return compiled.get(name);
}

function span(kind, text) {
  const s = document.createElement("span");
  s.className = `tok-${kind}`;
  s.textContent = text;
  return s;
}

// The code as nodes to append to a <code>: plain text where the language is unknown.
export function highlight(code, language) {
  const name = LANGUAGES[(language || "").toLowerCase()];
  if (!name) return [document.createTextNode(code)];
  const {pattern, words} = family(name);
  const nodes = [];
  let last = 0;
  pattern.lastIndex = 0;
  for (let m; (m = pattern.exec(code)); ) {
    if (!m[0]) { pattern.lastIndex++; continue; }
    const kind = KINDS[m.slice(1).findIndex((g) => g !== undefined)];
    if (kind === "word" && !words.has(m[0])) continue;
    if (m.index > last) nodes.push(document.createTextNode(code.slice(last, m.index)));
    nodes.push(span(kind === "word" ? "kw" : kind, m[0]));
    last = m.index + m[0].length;
  }
  if (last < code.length) nodes.push(document.createTextNode(code.slice(last)));
  return nodes;
}
