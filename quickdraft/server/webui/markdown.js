// quickdraft's chat page: a small markdown renderer with code highlighting, in plain JS.
//
// render(src, marks) turns an answer's markdown into HTML. Every character it shows keeps its
// offset in `src`, so `marks` ([start, end) ranges of `src`, UTF-16 offsets) come out as
// <span class="dr"> around the text they cover, in paragraphs, lists, tables and code blocks
// alike: the chat page marks the tokens that came from accepted drafts this way.
// Supported: fenced code (``` and ~~~, highlighted), headings, paragraphs, lists (nested,
// ordered), block quotes, tables, rules; inline code, strong, emphasis, strikethrough, links
// (http, https, mailto only) and bare URLs. All text is escaped; no HTML passes through.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESCAPES[c]);

// ------------------------------------------------------------------------------ highlighting

const CLASSES = ["", "com", "str", "meta", "num", "kw", "lit", "bi", "fn"];
const CLS = Object.fromEntries(CLASSES.map((c, i) => [c, i]));
const words = (s) => new Set(s.split(/\s+/).filter(Boolean));
const NUMBER = String.raw`\b(?:0[xX][\da-fA-F_]+|0[bB][01_]+|\d[\d_]*(?:\.\d[\d_]*)?(?:[eE][+-]?\d+)?)[a-zA-Z]*\b`;
const DQ = String.raw`"(?:\\.|[^"\\\n])*"`;
const SQ = String.raw`'(?:\\.|[^'\\\n])*'`;
const END = String.raw`(?![\s\S])`; // the end of the code (an answer still streaming, or cut short)
const C_COMMENTS = [String.raw`\/\/.*`, String.raw`\/\*[\s\S]*?(?:\*\/|${END})`];

const C_KW = `auto break case catch char class const constexpr continue default delete do double
  else enum explicit extern final float for friend goto if inline int long mutable namespace new
  noexcept operator override private protected public register return short signed sizeof static
  struct switch template this throw try typedef typename union unsigned using virtual void volatile
  while abstract assert boolean byte extends implements import instanceof interface native package
  strictfp super synchronized throws transient var val fun func go chan defer fallthrough map range
  select type fn let mut impl trait pub use mod crate self Self where match loop move ref dyn async
  await unsafe extern in is as object when init lazy internal open data sealed suspend guard
  protocol extension struct def yield lambda string bool`;

const LANGS = {
  python: {
    com: ["#.*"],
    str: [String.raw`[rRbBuUfF]{0,2}(?:"""[\s\S]*?(?:"""|${END})|'''[\s\S]*?(?:'''|${END})|${DQ}|${SQ})`],
    meta: [String.raw`@[\w.]+`],
    kw: words(`and as assert async await break class continue def del elif else except finally for
      from global if import in is lambda match case nonlocal not or pass raise return try while
      with yield`),
    lit: words("True False None self cls"),
    bi: words(`print len range int str float list dict set tuple bool bytes open type isinstance
      super enumerate zip map filter sorted reversed sum min max abs any all iter next repr
      object Exception ValueError TypeError KeyError`),
  },
  js: {
    com: C_COMMENTS,
    str: [DQ, SQ, "`(?:\\\\.|[^`\\\\])*`?"],
    meta: [String.raw`@\w+`],
    kw: words(`async await break case catch class const continue debugger default delete do else
      export extends finally for from function if import in instanceof let new of return static
      super switch this throw try typeof var void while with yield interface type enum implements
      public private protected readonly as`),
    lit: words("true false null undefined NaN Infinity"),
    bi: words("console document window Math JSON Promise Array Object String Number Map Set Error"),
  },
  clike: {
    com: C_COMMENTS,
    str: [DQ, String.raw`'(?:\\.|[^'\\\n]){1,4}'`],
    meta: [String.raw`^[ \t]*#[ \t]*\w+`, String.raw`@\w+`, String.raw`#!?\[[^\]\n]*\]`],
    kw: words(C_KW),
    lit: words("true false null nullptr nil None NULL Some Ok Err"),
    bi: words(`std printf println print fmt String Vec Option Result System cout cin endl size_t
      uint8_t int32_t int64_t uint32_t uint64_t usize isize u8 u16 u32 u64 i8 i16 i32 i64 f32 f64`),
  },
  shell: {
    com: [String.raw`(?:^|[ \t])#.*`],
    str: [DQ, String.raw`'[^'\n]*'`],
    meta: [String.raw`\$\{[^}\n]*\}|\$\w+|\$[@#?$!*-]`],
    kw: words(`if then else elif fi for while until do done case esac function in return export
      local select`),
    lit: words("true false"),
    bi: words(`echo cd exit set source alias sudo ls cat grep sed awk curl pip python git make
      mkdir rm cp mv chmod printf read test apt apt-get docker`),
  },
  sql: {
    com: [String.raw`--.*`, String.raw`\/\*[\s\S]*?(?:\*\/|${END})`],
    str: [SQ, DQ],
    meta: [],
    ci: true,
    kw: words(`select from where and or not insert into values update set delete create table
      drop alter add primary key foreign references join left right inner outer full on group by
      order having limit offset as distinct union all case when then else end is null like in
      between exists index view default unique constraint with returning asc desc`),
    lit: words("true false null"),
    bi: words("count sum avg min max coalesce cast now integer int text varchar boolean real"),
  },
  markup: {
    com: [String.raw`<!--[\s\S]*?(?:-->|${END})`],
    str: [DQ, SQ],
    meta: [String.raw`<\/?[A-Za-z][\w:.-]*|\/?>`],
    kw: new Set(),
    lit: new Set(),
    bi: new Set(),
  },
  css: {
    com: [String.raw`\/\*[\s\S]*?(?:\*\/|${END})`],
    str: [DQ, SQ],
    meta: [String.raw`[.#][A-Za-z_-][\w-]*(?=[^{};]*\{)`, String.raw`@[\w-]+`, String.raw`#[\da-fA-F]{3,8}\b`],
    kw: words("important inherit initial auto none"),
    lit: new Set(),
    bi: new Set(),
  },
  conf: {
    com: [String.raw`(?:^|[ \t])[#;].*`],
    str: [DQ, SQ],
    meta: [String.raw`^[ \t]*-?[ \t]*[\w.-]+(?=[ \t]*[:=])`, String.raw`^\[[^\]\n]*\]`],
    kw: new Set(),
    lit: words("true false null yes no on off"),
    bi: new Set(),
  },
  plain: { com: [], str: [], meta: [], kw: new Set(), lit: new Set(), bi: new Set() },
};

const ALIASES = {
  py: "python", python3: "python", ipython: "python", pycon: "python",
  javascript: "js", jsx: "js", mjs: "js", cjs: "js", ts: "js", typescript: "js", tsx: "js", json: "js",
  jsonc: "js", c: "clike", h: "clike", cpp: "clike", "c++": "clike", cc: "clike", hpp: "clike",
  cxx: "clike", java: "clike", cs: "clike", csharp: "clike", go: "clike", golang: "clike",
  rust: "clike", rs: "clike", kotlin: "clike", kt: "clike", swift: "clike", scala: "clike",
  dart: "clike", php: "clike", cuda: "clike", zig: "clike",
  sh: "shell", bash: "shell", zsh: "shell", console: "shell", shell: "shell", ps1: "shell",
  powershell: "shell", dockerfile: "shell", makefile: "shell",
  html: "markup", xml: "markup", svg: "markup", vue: "markup",
  scss: "css", less: "css", yaml: "conf", yml: "conf", toml: "conf", ini: "conf", cfg: "conf",
  text: "plain", txt: "plain", markdown: "plain", md: "plain", diff: "plain",
};

const compiled = new Map();

function grammar(lang) {
  const name = LANGS[lang] ? lang : ALIASES[lang] || (lang ? "clike" : "plain");
  if (!compiled.has(name)) {
    const g = LANGS[name];
    const group = (list) => (list.length ? `(${list.join("|")})` : "(?!)");
    const source = [group(g.com), group(g.str), group(g.meta), `(${NUMBER})`, String.raw`([A-Za-z_$][\w$]*)`];
    compiled.set(name, { ...g, re: new RegExp(source.join("|"), "gm" + (g.ci ? "i" : "")) });
  }
  return compiled.get(name);
}

/** One class index (see CLASSES) per character of `code` in language `lang`. */
export function highlight(code, lang) {
  const g = grammar((lang || "").toLowerCase());
  const classes = new Uint8Array(code.length);
  g.re.lastIndex = 0;
  let m;
  while ((m = g.re.exec(code)) !== null) {
    if (m[0].length === 0) {
      g.re.lastIndex++;
      continue;
    }
    let cls = 0;
    if (m[1] !== undefined) cls = CLS.com;
    else if (m[2] !== undefined) cls = CLS.str;
    else if (m[3] !== undefined) cls = CLS.meta;
    else if (m[4] !== undefined) cls = CLS.num;
    else cls = wordClass(g, m[5], code, g.re.lastIndex);
    if (cls) classes.fill(cls, m.index, m.index + m[0].length);
  }
  return classes;
}

function wordClass(g, word, code, end) {
  const w = g.ci ? word.toLowerCase() : word;
  if (g.kw.has(w)) return CLS.kw;
  if (g.lit.has(w)) return CLS.lit;
  if (g.bi.has(w)) return CLS.bi;
  return /^[ \t]*\(/.test(code.slice(end, end + 8)) ? CLS.fn : 0;
}

// ---------------------------------------------------------------------- text with positions

// A run of rendered text: its characters and each one's offset in the source.
function textOf(pieces) {
  let text = "";
  const pos = [];
  pieces.forEach((piece, n) => {
    if (n > 0) {
      const prev = pieces[n - 1];
      text += "\n";
      pos.push(prev.s + prev.t.length);
    }
    text += piece.t;
    for (let i = 0; i < piece.t.length; i++) pos.push(piece.s + i);
  });
  return { text, pos };
}

// HTML of characters [a, b) of run `r`, escaped, split where the marks (or `classes`) change.
function emit(ctx, r, a, b, classes) {
  let out = "";
  for (let k = a; k < b; ) {
    const mark = ctx.mask[r.pos[k]];
    const cls = classes ? classes[k] : 0;
    let e = k + 1;
    while (e < b && ctx.mask[r.pos[e]] === mark && (classes ? classes[e] : 0) === cls) e++;
    const html = escapeHtml(r.text.slice(k, e));
    const names = [cls ? `hl-${CLASSES[cls]}` : "", mark ? "dr" : ""].filter(Boolean).join(" ");
    out += names ? `<span class="${names}">${html}</span>` : html;
    k = e;
  }
  return out;
}

// ---------------------------------------------------------------------------------- inline

const PUNCT = /[!"#$%&'()*+,\-./:;<=>?@[\\\]^_`{|}~]/;
const URL_AT = /https?:\/\/[^\s<>()"'`]*[^\s<>()"'`.,;:!?*_]/y;
const SAFE_URL = /^(?:https?:\/\/|mailto:)/i;

function inline(ctx, r, a, b) {
  let out = "";
  let lit = a;
  const flush = (to) => {
    if (to > lit) out += emit(ctx, r, lit, to);
  };
  for (let i = a; i < b; ) {
    const ch = r.text[i];
    let got = null;
    if (ch === "\\" && i + 1 < b && PUNCT.test(r.text[i + 1])) {
      flush(i);
      lit = i + 1;
      i += 2;
      continue;
    }
    if (ch === "\n") got = { html: "<br>", next: i + 1 };
    else if (ch === "`") got = codeSpan(ctx, r, i, b);
    else if (ch === "*" || ch === "_" || ch === "~") got = emphasis(ctx, r, i, b);
    else if (ch === "[") got = link(ctx, r, i, b);
    else if (ch === "h" && (i === 0 || !/\w/.test(r.text[i - 1]))) got = bareUrl(ctx, r, i, b);
    if (got) {
      flush(i);
      out += got.html;
      i = lit = got.next;
    } else {
      i++;
    }
  }
  flush(b);
  return out;
}

function run(text, i, ch, b = text.length) {
  let n = 0;
  while (i + n < b && text[i + n] === ch) n++;
  return n;
}

function codeSpan(ctx, r, i, b) {
  const n = run(r.text, i, "`");
  for (let j = r.text.indexOf("`".repeat(n), i + n); j >= 0 && j < b; j = r.text.indexOf("`".repeat(n), j + 1)) {
    const len = run(r.text, j, "`");
    if (len !== n) {
      j += len - 1;
      continue;
    }
    let s = i + n;
    let e = j;
    if (e - s >= 2 && r.text[s] === " " && r.text[e - 1] === " " && r.text.slice(s, e).trim()) {
      s++;
      e--;
    }
    return { html: `<code>${emit(ctx, r, s, e)}</code>`, next: j + n };
  }
  return { html: emit(ctx, r, i, i + n), next: i + n }; // no closing run (yet): literal
}

function emphasis(ctx, r, i, b) {
  const ch = r.text[i];
  const n = run(r.text, i, ch);
  const after = r.text[i + n];
  if (after === undefined || /\s/.test(after)) return null;
  if (ch === "_" && i > 0 && /\w/.test(r.text[i - 1])) return null; // snake_case
  if (ch === "~") return n === 2 ? wrapped(ctx, r, i, b, "~~", "del") : null;
  if (n >= 2) return wrapped(ctx, r, i, b, ch + ch, "strong");
  return wrapped(ctx, r, i, b, ch, "em");
}

// <tag> around the text from i (after `delim`) to the next `delim` closing it, or null.
function wrapped(ctx, r, i, b, delim, tag) {
  const d = delim.length;
  const ch = delim[0];
  for (let j = r.text.indexOf(delim, i + d + 1); j >= 0 && j + d <= b; j = r.text.indexOf(delim, j + 1)) {
    const len = run(r.text, j, ch, b);
    if (/\s/.test(r.text[j - 1])) {
      j += len - 1;
      continue;
    }
    if (d === 1 && len === 2) {
      j += 1; // a ** inside *...*: not this one's end
      continue;
    }
    if (ch === "_" && /\w/.test(r.text[j + len] || "")) continue;
    const end = j + len - d; // the last `d` characters of a longer run close it
    return { html: `<${tag}>${inline(ctx, r, i + d, end)}</${tag}>`, next: end + d };
  }
  return null;
}

function link(ctx, r, i, b) {
  let depth = 0;
  let close = -1;
  for (let j = i; j < b; j++) {
    if (r.text[j] === "[") depth++;
    else if (r.text[j] === "]" && --depth === 0) {
      close = j;
      break;
    }
  }
  if (close < 0 || r.text[close + 1] !== "(") return null;
  const end = r.text.indexOf(")", close + 2);
  if (end < 0 || end >= b) return null;
  const url = r.text.slice(close + 2, end).trim().split(/\s+/)[0];
  if (!SAFE_URL.test(url)) return null;
  const label = inline(ctx, r, i + 1, close);
  return { html: `<a href="${escapeHtml(url)}" target="_blank" rel="noopener noreferrer">${label}</a>`, next: end + 1 };
}

function bareUrl(ctx, r, i, b) {
  URL_AT.lastIndex = i;
  const m = URL_AT.exec(r.text);
  if (!m || i + m[0].length > b) return null;
  const e = i + m[0].length;
  return { html: `<a href="${escapeHtml(m[0])}" target="_blank" rel="noopener noreferrer">${emit(ctx, r, i, e)}</a>`, next: e };
}

// ----------------------------------------------------------------------------------- blocks

const BLANK = /^\s*$/;
const FENCE = /^( {0,3})(`{3,}|~{3,})[ \t]*([^\s`]*)/;
const HEADING = /^ {0,3}(#{1,6})[ \t]+/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:[ \t]+|$)/;
const DELIMITER = /^ *\|? *:?-+:? *(?:\| *:?-+:? *)*\|? *$/;

const cut = (line, n) => ({ t: line.t.slice(n), s: line.s + n });
const indentOf = (t) => t.length - t.trimStart().length;

function startsBlock(t) {
  return FENCE.test(t) || HEADING.test(t) || RULE.test(t) || QUOTE.test(t) || ITEM.test(t);
}

function blocks(ctx, lines, tight) {
  let out = "";
  for (let i = 0; i < lines.length; ) {
    const t = lines[i].t;
    let m;
    let got;
    if (BLANK.test(t)) got = { html: "", next: i + 1 };
    else if ((m = FENCE.exec(t))) got = fence(ctx, lines, i, m);
    else if ((m = HEADING.exec(t))) got = heading(ctx, lines, i, m);
    else if (RULE.test(t)) got = { html: "<hr>", next: i + 1 };
    else if (QUOTE.test(t)) got = quote(ctx, lines, i);
    else if ((m = ITEM.exec(t))) got = list(ctx, lines, i, m);
    else if (t.includes("|") && i + 1 < lines.length && DELIMITER.test(lines[i + 1].t) && lines[i + 1].t.includes("-")) got = table(ctx, lines, i);
    else got = paragraph(ctx, lines, i, tight);
    out += got.html;
    i = got.next;
  }
  return out;
}

function fence(ctx, lines, i, m) {
  const indent = m[1].length;
  const mark = m[2];
  const close = new RegExp(`^ {0,3}${mark[0] === "`" ? "`" : "~"}{${mark.length},}[ \\t]*$`);
  const body = [];
  let j = i + 1;
  for (; j < lines.length && !close.test(lines[j].t); j++) body.push(cut(lines[j], Math.min(indent, indentOf(lines[j].t))));
  const r = textOf(body);
  const lang = m[3].toLowerCase();
  const code = emit(ctx, r, 0, r.text.length, highlight(r.text, lang));
  const label = escapeHtml(lang || "code");
  const html =
    `<div class="code"><div class="code-head"><span class="code-lang">${label}</span>` +
    `<button type="button" class="copy" title="Copy the code">Copy</button></div>` +
    `<pre><code${lang ? ` class="language-${escapeHtml(lang)}"` : ""}>${code}</code></pre></div>`;
  return { html, next: j + 1 };
}

function heading(ctx, lines, i, m) {
  const level = m[1].length;
  const text = lines[i].t.slice(m[0].length).replace(/[ \t]+#+[ \t]*$/, "").trimEnd();
  const r = textOf([{ t: text, s: lines[i].s + m[0].length }]);
  return { html: `<h${level}>${inline(ctx, r, 0, r.text.length)}</h${level}>`, next: i + 1 };
}

function paragraph(ctx, lines, i, tight) {
  const pieces = [];
  let j = i;
  for (; j < lines.length && !BLANK.test(lines[j].t) && (j === i || !startsBlock(lines[j].t)); j++) {
    const indent = indentOf(lines[j].t);
    pieces.push(cut(lines[j], indent));
  }
  const last = pieces[pieces.length - 1];
  pieces[pieces.length - 1] = { t: last.t.trimEnd(), s: last.s };
  const r = textOf(pieces);
  const html = inline(ctx, r, 0, r.text.length);
  return { html: tight ? html : `<p>${html}</p>`, next: j };
}

function quote(ctx, lines, i) {
  const inner = [];
  let j = i;
  for (; j < lines.length && QUOTE.test(lines[j].t); j++) inner.push(cut(lines[j], QUOTE.exec(lines[j].t)[0].length));
  return { html: `<blockquote>${blocks(ctx, inner, false)}</blockquote>`, next: j };
}

function list(ctx, lines, i, m) {
  const ordered = /\d/.test(m[2]);
  const base = m[1].length;
  const first = ordered ? parseInt(m[2], 10) : 1;
  let out = ordered ? (first !== 1 ? `<ol start="${first}">` : "<ol>") : "<ul>";
  let j = i;
  let mm;
  while (j < lines.length && (mm = ITEM.exec(lines[j].t)) && mm[1].length === base && /\d/.test(mm[2]) === ordered) {
    const item = listItem(lines, j, mm);
    out += `<li>${blocks(ctx, item.lines, !item.loose)}</li>`;
    j = item.next;
  }
  return { html: out + (ordered ? "</ol>" : "</ul>"), next: j };
}

function listItem(lines, i, m) {
  const content = m[0].length > m[1].length + m[2].length ? m[0].length : m[1].length + m[2].length + 1;
  const item = [cut(lines[i], Math.min(m[0].length, lines[i].t.length))];
  let loose = false;
  let j = i + 1;
  while (j < lines.length) {
    const t = lines[j].t;
    if (BLANK.test(t)) {
      let k = j;
      while (k < lines.length && BLANK.test(lines[k].t)) k++;
      if (k >= lines.length || indentOf(lines[k].t) < content) break;
      for (; j < k; j++) item.push({ t: "", s: lines[j].s });
      loose = true;
      continue;
    }
    const indent = indentOf(t);
    if (indent >= content) item.push(cut(lines[j], content));
    else if (!startsBlock(t) && !BLANK.test(item[item.length - 1].t)) item.push(cut(lines[j], indent)); // lazy line
    else break;
    j++;
  }
  return { lines: item, loose, next: j };
}

function cells(line) {
  const out = [];
  let start = 0;
  const t = line.t;
  for (let k = 0; k <= t.length; k++) {
    if (k === t.length || (t[k] === "|" && t[k - 1] !== "\\")) {
      out.push({ t: t.slice(start, k), s: line.s + start });
      start = k + 1;
    }
  }
  if (out.length && BLANK.test(out[0].t)) out.shift();
  if (out.length && BLANK.test(out[out.length - 1].t)) out.pop();
  return out.map((c) => {
    const lead = indentOf(c.t);
    return { t: c.t.trim(), s: c.s + lead };
  });
}

function table(ctx, lines, i) {
  const align = cells(lines[i + 1]).map((c) =>
    c.t.startsWith(":") && c.t.endsWith(":") ? "center" : c.t.endsWith(":") ? "right" : c.t.startsWith(":") ? "left" : "",
  );
  const row = (line, tag) =>
    "<tr>" +
    cells(line)
      .map((c, k) => {
        const r = textOf([c]);
        const style = align[k] ? ` style="text-align:${align[k]}"` : "";
        return `<${tag}${style}>${inline(ctx, r, 0, r.text.length)}</${tag}>`;
      })
      .join("") +
    "</tr>";
  let out = `<div class="table"><table><thead>${row(lines[i], "th")}</thead><tbody>`;
  let j = i + 2;
  for (; j < lines.length && lines[j].t.includes("|") && !BLANK.test(lines[j].t); j++) out += row(lines[j], "td");
  return { html: out + "</tbody></table></div>", next: j };
}

// ------------------------------------------------------------------------------------ render

/** HTML of markdown `src`, with the characters in `marks` ([start, end) offsets) marked. */
export function render(src, marks) {
  const mask = new Uint8Array(src.length + 1);
  for (const [a, b] of marks || []) mask.fill(1, Math.max(0, a), Math.min(src.length, b));
  const lines = [];
  let s = 0;
  for (const t of src.split("\n")) {
    lines.push({ t, s });
    s += t.length + 1;
  }
  return blocks({ mask }, lines, false);
}
