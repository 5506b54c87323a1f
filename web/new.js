// #/new: create a run. The form is made from the run config's schema as the server serves
// it (GET /config/schema): a fieldset per section, an input per key with its default and
// bounds. Or the config pasted as TOML. Each draft is checked by the server as one types
// (POST /config/check) and its sentence shown; Create sends the checked config with the
// training text (POST /runs, multipart) and opens the new run.

import { api, h, int, replace, si } from "./dom.js";
import { authed, cannotCreate, me, onChange, refreshMe } from "./session.js";
import { ready, showNotice } from "./ui.js";

const CHECK_MS = 300;
// keys the page fills itself or leaves to the CLI: data.path is the chosen file's name; a
// prepared dataset (data.dataset) and starting weights (model.init) are uploaded by
// `diloco run create` (a TOML naming an uploaded dataset's ds_ id works here too)
const SKIP = new Set(["data.path", "data.dataset", "model.init"]);
const NO_FILE_YET = "data.txt"; // data.path while no file is chosen, so the rest is checked

const shown = (v) => (v === null ? "none" : typeof v === "object" ? JSON.stringify(v) : String(v));

/** A property's schema with an ``anyOf: [X, null]`` unwrapped into X plus ``nullable``. */
function unwrap(prop) {
  if (!prop.anyOf) return { ...prop, nullable: false };
  const other = prop.anyOf.filter((p) => p.type !== "null");
  return { ...prop, ...other[0], nullable: other.length < prop.anyOf.length };
}

function bounds(f) {
  const parts = [];
  if (f.minimum !== undefined) parts.push(`≥ ${f.minimum}`);
  if (f.exclusiveMinimum !== undefined) parts.push(`> ${f.exclusiveMinimum}`);
  if (f.maximum !== undefined) parts.push(`≤ ${f.maximum}`);
  if (f.exclusiveMaximum !== undefined) parts.push(`< ${f.exclusiveMaximum}`);
  if (f.maxLength !== undefined) parts.push(`${f.minLength || 0}–${f.maxLength} characters`);
  return parts.join(", ");
}

/** One input of the form: ``{section, key, required, el, read(), write(value)}``. */
function control(section, key, prop, required, onInput) {
  const f = unwrap(prop);
  const id = section ? `cfg-${section}-${key}` : `cfg-${key}`;
  const hasDefault = Object.hasOwn(prop, "default");
  const hint = [required ? "required" : hasDefault ? `default ${shown(prop.default)}` : "optional", bounds(f)]
    .filter(Boolean).join("; ");
  const choices = f.type === "boolean" ? [true, false] : f.enum || null;
  let el;
  if (choices) {
    el = h("select", { id, onchange: onInput },
      h("option", { value: "", text: hasDefault ? `default (${shown(prop.default)})` : "choose" }),
      choices.map((c, i) => h("option", { value: String(i), text: String(c) })));
  } else {
    const numeric = f.type === "integer" || f.type === "number";
    el = h("input", { id, type: "text", autocomplete: "off", spellcheck: "false", oninput: onInput,
      inputmode: numeric ? (f.type === "integer" ? "numeric" : "decimal") : null,
      maxlength: f.maxLength, placeholder: hasDefault ? shown(prop.default) : "" });
  }
  const numeric = f.type === "integer" || f.type === "number";
  return {
    section, key, id, required, input: el,
    el: h("div", { class: "field" }, h("label", { for: id, text: key }), el,
      h("span", { class: "muted small", id: `${id}-hint`, text: hint })),
    /** The value to send; undefined: left out, the server's default applies. */
    read() {
      if (choices) return el.value === "" ? undefined : choices[Number(el.value)];
      const text = el.value.trim();
      if (text === "") return undefined;
      if (!numeric) return text;
      const n = Number(text);
      return Number.isFinite(n) ? n : text; // text: the server's sentence names the key
    },
    write(value) {
      if (choices) {
        const i = choices.indexOf(value);
        el.value = value === null || i < 0 ? "" : String(i);
      } else el.value = value === null || value === undefined ? "" : String(value);
    },
  };
}

function tomlValue(v) {
  return typeof v === "string" ? JSON.stringify(v) : String(v); // a JSON string is a TOML one
}

/** A draft (no nulls: those are left out) as TOML: top-level keys, then a table a section. */
function toToml(draft) {
  const top = Object.entries(draft).filter(([, v]) => typeof v !== "object");
  const tables = Object.entries(draft).filter(([, v]) => typeof v === "object");
  const lines = top.map(([k, v]) => `${k} = ${tomlValue(v)}`);
  for (const [name, values] of tables) {
    lines.push("", `[${name}]`, ...Object.entries(values).map(([k, v]) => `${k} = ${tomlValue(v)}`));
  }
  return `${lines.join("\n")}\n`;
}

export function newRunPage(main) {
  const state = { mode: "form", checked: null, error: null, checking: true, creating: false };
  let controls = [];
  let timer = null;
  let seq = 0;
  let stopped = false;

  const modeButtons = [["form", "Form"], ["toml", "Paste TOML"]].map(([mode, text]) =>
    h("button", { type: "button", "aria-pressed": String(mode === state.mode), text, onclick: () => setMode(mode) }));
  const fileInput = h("input", { id: "data-file", type: "file", accept: ".txt,text/plain", onchange: () => schedule() });
  const fileNote = h("span", { class: "muted small", id: "data-file-note" });
  const formBox = h("div", { id: "config-form" }, h("p", { class: "muted", text: "Loading the config schema…" }));
  const toml = h("textarea", { id: "config-toml", rows: 18, spellcheck: "false", oninput: () => schedule() });
  const tomlBox = h("div", { hidden: true },
    h("label", { for: "config-toml", text: "Run config (TOML), as diloco run create reads it" }), toml);
  const checkLine = h("p", { id: "config-check", class: "control-msg", role: "status", "aria-live": "polite" });
  const createButton = h("button", { type: "submit", id: "create-run", text: "Create run" });
  const reasonLine = h("span", { id: "create-reason", class: "muted" });
  const createMsg = h("p", { class: "control-msg", role: "status", "aria-live": "polite" });
  const page = h("form", { class: "new-run", onsubmit: (e) => { e.preventDefault(); create(); } },
    h("div", { class: "toolbar", role: "group", "aria-label": "config as" }, modeButtons),
    formBox, tomlBox,
    h("fieldset", {}, h("legend", { text: "Training data" }),
      h("div", { class: "field" }, h("label", { for: "data-file", text: "Text file (each byte is a token)" }),
        fileInput, fileNote)),
    h("div", { class: "create-bar" }, checkLine, h("div", { class: "actions" }, createButton, reasonLine), createMsg));
  replace(main, h("h1", { text: "New run" }),
    h("p", { class: "muted" }, "Every key left empty takes the server's default; each change is checked by the server. ",
      "A run on a prepared dataset or from starting weights: ", h("code", { text: "diloco run create CONFIG.toml --server URL" }), "."),
    page);

  // ------------------------------------------------------------ the draft
  function file() {
    return fileInput.files && fileInput.files.length ? fileInput.files[0] : null;
  }

  function draft() {
    const out = {};
    for (const c of controls) {
      const value = c.read();
      if (value === undefined) continue;
      if (c.section) (out[c.section] ??= {})[c.key] = value;
      else out[c.key] = value;
    }
    out.data = { path: file() ? file().name : NO_FILE_YET, ...(out.data || {}) };
    return out;
  }

  function build(schema) {
    const defs = schema.$defs || {};
    const top = [];
    const sections = [];
    for (const [key, prop] of Object.entries(schema.properties)) {
      const ref = prop.$ref || (prop.allOf && prop.allOf[0].$ref);
      if (!ref) {
        top.push(control(null, key, prop, (schema.required || []).includes(key), schedule));
        continue;
      }
      const def = defs[ref.split("/").pop()];
      const fields = Object.entries(def.properties).filter(([k]) => !SKIP.has(`${key}.${k}`))
        .map(([k, p]) => control(key, k, p, (def.required || []).includes(k), schedule));
      sections.push([key, def, fields]);
    }
    controls = [...top, ...sections.flatMap(([, , fields]) => fields)];
    replace(formBox,
      h("fieldset", {}, h("legend", { text: "run" }), h("div", { class: "fields" }, top.map((c) => c.el))),
      sections.map(([key, def, fields]) => h("fieldset", { id: `section-${key}` }, h("legend", { text: `[${key}]` }),
        def.description ? h("p", { class: "muted small", text: def.description.split("\n\n")[0].replace(/``/g, "") }) : null,
        key === "data" ? h("p", { class: "muted small", text: "data.path is the name of the file chosen below." }) : null,
        h("div", { class: "fields" }, fields.map((c) => c.el)))));
  }

  function setMode(mode) {
    if (mode === state.mode) return;
    if (mode === "toml") toml.value = toToml(draft());
    else if (state.checked && !state.checking) {
      const config = state.checked.config;
      for (const c of controls) c.write(c.section ? (config[c.section] || {})[c.key] : config[c.key]);
    } else {
      const why = state.checking ? "was still being checked" : "does not check out";
      createMsg.textContent = `The TOML ${why}: the form keeps the values it had.`;
    }
    if (mode === "toml" || (state.checked && !state.checking)) createMsg.textContent = "";
    state.mode = mode;
    modeButtons.forEach((b, i) => b.setAttribute("aria-pressed", String(["form", "toml"][i] === mode)));
    formBox.hidden = mode !== "form";
    tomlBox.hidden = mode !== "toml";
    schedule();
  }

  // ------------------------------------------------------------ checking
  function schedule() {
    state.checking = true;
    render();
    clearTimeout(timer);
    timer = setTimeout(check, CHECK_MS);
  }

  async function check() {
    const mine = ++seq;
    const body = state.mode === "toml" ? { toml: toml.value } : { config: draft() };
    let checked = null;
    let error = null;
    // a required key left empty is said here: the schema says so, the server need not
    const empty = state.mode === "form" ? controls.find((c) => c.required && c.read() === undefined) : null;
    if (empty) error = `${empty.section ? `${empty.section}.` : ""}${empty.key}: required: give it a value`;
    else {
      try {
        checked = await api("/config/check", { method: "POST", body });
      } catch (err) {
        error = err.status === 422 || err.status === 400 ? err.message : `could not check: ${err.message}`;
      }
    }
    if (mine !== seq || stopped) return; // a newer draft is being checked
    Object.assign(state, { checked, error, checking: false });
    render();
  }

  /** Why Create cannot be used now, or null. */
  function whyNot() {
    const who = me();
    const denied = cannotCreate(who);
    if (denied) return denied;
    if (state.checking) return "checking the config…";
    if (state.error) return "the config does not check out";
    if (!state.checked) return "the config is not checked yet";
    const { config, parameters } = state.checked;
    if (config.data.path !== null && !file()) return "choose the training text file";
    const q = who.quota && who.quota.effective;
    if (q && parameters !== null && parameters > q.params) {
      return `the model has ${si(parameters)} parameters, over your quota of ${si(q.params)}`;
    }
    if (q && file() && config.data.path !== null && file().size > q.data_bytes) {
      return `the file is ${si(file().size, "B")}, over your quota of ${si(q.data_bytes, "B")}`;
    }
    return null;
  }

  function render() {
    const f = file();
    fileNote.textContent = f ? `${int(f.size)} bytes` : "";
    // the keys the server's sentence names ("rounds.quorum: ...; name: ...") are marked
    const named = new Set((state.error || "").split("; ").map((part) => part.split(": ")[0]));
    for (const c of controls) {
      if (named.has(c.section ? `${c.section}.${c.key}` : c.key)) c.input.setAttribute("aria-invalid", "true");
      else c.input.removeAttribute("aria-invalid");
    }
    if (state.checking) {
      checkLine.className = "control-msg muted";
      checkLine.textContent = "Checking…";
    } else if (state.error) {
      checkLine.className = "control-msg close-error";
      checkLine.textContent = state.error;
    } else if (state.checked) {
      const p = state.checked.parameters;
      checkLine.className = "control-msg ok";
      checkLine.textContent = `The config checks out${p === null ? "" : `: ${si(p)} parameters (${int(p)})`}.`;
    }
    const why = state.creating ? "creating the run…" : whyNot();
    createButton.disabled = Boolean(why);
    if (why) createButton.title = why;
    else createButton.removeAttribute("title");
    reasonLine.textContent = why ? `Cannot create yet: ${why}.` : "";
  }

  async function create() {
    if (whyNot() || state.creating) return;
    const config = structuredClone(state.checked.config);
    const form = new FormData();
    if (config.data.path !== null) config.data.path = file().name;
    form.append("config", JSON.stringify(config));
    if (config.data.path !== null) form.append("data", file(), file().name);
    state.creating = true;
    createMsg.textContent = "Creating the run: the server splits the data and writes version 0…";
    render();
    try {
      const run = await authed("/runs", { method: "POST", body: form });
      location.hash = `#/runs/${encodeURIComponent(run.id)}`;
    } catch (err) {
      createMsg.textContent = `The hub did not create the run: ${err.message}`;
      state.creating = false;
      refreshMe(); // a quota or a role may have changed
      render();
    }
  }

  const unsubscribe = onChange(() => render());
  Promise.all([api("/config/schema"), refreshMe()]).then(([schema]) => {
    if (stopped) return;
    build(schema);
    schedule();
    ready();
  }, (err) => {
    showNotice(`Could not load the config schema: ${err.message}`);
    replace(formBox, h("p", { class: "close-error", text: err.message }));
  });
  return () => {
    stopped = true;
    clearTimeout(timer);
    unsubscribe();
  };
}
