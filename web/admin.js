// #/admin: the hub's accounts (admin token): roles, runs owned, ban and quarantine with
// their reasons; grant and revoke roles, set a run owner's quota, ban from the hub.

import { ago, h, int, replace, when } from "./dom.js";
import { authed, refreshMe } from "./session.js";
import { poll, ready, table } from "./ui.js";

const PAGE = 100;
const ROLES = ["owner", "verifier"];
const QUOTA = [ // key, label, what it limits
  ["runs", "Runs", "runs not ended (active or paused) at once"],
  ["params", "Parameters", "a run's model parameters"],
  ["data_bytes", "Data bytes", "a run's training data, in bytes"],
];

function standing(a) {
  const parts = [];
  if (a.banned_at) parts.push(`banned ${when(a.banned_at)}: ${a.ban_reason}`);
  if (a.quarantined_at) parts.push(`quarantined ${when(a.quarantined_at)}: ${a.quarantine_reason}`);
  return parts.length ? parts.join("; ") : "in good standing";
}

export function adminPage(main) {
  const state = { offset: 0, accounts: [], total: 0, selected: null, shown: null };
  const list = h("div", { id: "accounts" });
  const panel = h("section", { id: "account-panel", "aria-label": "Account", hidden: true });
  const msg = h("p", { class: "control-msg", role: "status", "aria-live": "polite" });
  replace(main, h("h1", { text: "Accounts" }), list, msg, panel);

  // ------------------------------------------------------------ the selected account
  const title = h("h2", {});
  const stateLine = h("p", { id: "account-state" });
  const roleButtons = ROLES.map((role) => h("button", { type: "button", class: "role", onclick: () => toggleRole(role) }));
  const quotaInputs = QUOTA.map(([key, text]) =>
    h("input", { id: `quota-${key}`, type: "text", inputmode: "numeric", autocomplete: "off", "aria-label": text }));
  const quotaNote = h("p", { class: "muted small", id: "quota-note" });
  const quotaButton = h("button", { type: "submit", text: "Set quota" });
  const quotaForm = h("form", { class: "quota", onsubmit: (e) => { e.preventDefault(); saveQuota(); } },
    QUOTA.map(([key, text, what], i) => h("div", { class: "field" },
      h("label", { for: `quota-${key}`, text }), quotaInputs[i], h("span", { class: "muted small", text: what }))),
    h("div", { class: "actions" }, quotaButton));
  const quotaBox = h("div", {}, h("h3", { text: "Quota" }), quotaNote, quotaForm);
  const banReason = h("input", { id: "hub-ban-reason", maxlength: 500, autocomplete: "off", oninput: () => renderPanel() });
  const banButton = h("button", { type: "submit", text: "Ban from the hub" });
  const unbanButton = h("button", { type: "button", text: "Lift the hub ban", onclick: unban });
  const unquarantineButton = h("button", { type: "button", text: "Lift the quarantine", onclick: unquarantine });
  const banForm = h("form", { class: "token", onsubmit: (e) => { e.preventDefault(); ban(); } },
    h("label", { for: "hub-ban-reason", text: "Reason" }), banReason, banButton);
  replace(panel, title, stateLine,
    h("h3", { text: "Roles" }), h("div", { class: "actions" }, roleButtons),
    quotaBox,
    h("h3", { text: "Ban from the hub" }),
    h("p", { class: "muted small", text: "Its token is refused everywhere with the reason; its work in rounds not yet closed is left out." }),
    banForm, h("div", { class: "actions" }, unbanButton, unquarantineButton));

  function selected() {
    return state.accounts.find((a) => a.id === state.selected) || null;
  }

  function renderPanel() {
    const a = selected();
    panel.hidden = !a;
    if (!a) return;
    title.textContent = `${a.name} (${a.id})`;
    stateLine.textContent = `Created ${when(a.created_at)} · last seen ${ago(a.last_seen_at)} · ` +
      `${a.runs_owned} runs owned · ${standing(a)}`;
    ROLES.forEach((role, i) => {
      const has = a.roles.includes(role);
      roleButtons[i].textContent = `${has ? "Revoke" : "Grant"} ${role}`;
    });
    quotaBox.hidden = !a.roles.includes("owner");
    banButton.disabled = Boolean(a.banned_at) || !banReason.value.trim();
    banButton.title = a.banned_at ? "banned already: lift the ban first to change it" : banReason.value.trim() ? "" : "give a reason: the contributor is told it";
    unbanButton.disabled = !a.banned_at;
    unbanButton.title = a.banned_at ? "" : "not banned";
    unquarantineButton.disabled = !a.quarantined_at;
    unquarantineButton.title = a.quarantined_at ? "" : "not quarantined";
  }

  async function loadQuota() {
    const a = selected();
    if (!a || !a.roles.includes("owner")) return;
    const q = await authed(`/contributors/${encodeURIComponent(a.id)}/quota`);
    QUOTA.forEach(([key], i) => {
      quotaInputs[i].value = q.set[key] === null ? "" : String(q.set[key]);
      quotaInputs[i].placeholder = `default ${q.effective[key]}`;
    });
    quotaNote.textContent = `Now ${q.runs_not_ended} runs not ended; allowed: ${int(q.effective.runs)} runs, ` +
      `${int(q.effective.params)} parameters and ${int(q.effective.data_bytes)} data bytes a run. ` +
      "Empty: the hub's default. Runs already created stay.";
  }

  function select(id) {
    state.selected = id;
    banReason.value = "";
    renderPanel();
    loadQuota().catch((err) => { msg.textContent = `Could not read the quota: ${err.message}`; });
    title.scrollIntoView({ block: "nearest" });
  }

  // ------------------------------------------------------------ actions
  async function attempt(doing, work) {
    msg.textContent = `${doing}…`;
    try {
      msg.textContent = await work();
      await refresh();
    } catch (err) {
      msg.textContent = `${doing} failed: ${err.message}`;
    }
  }

  function toggleRole(role) {
    const a = selected();
    const path = `/contributors/${encodeURIComponent(a.id)}/roles`;
    if (a.roles.includes(role)) {
      return attempt(`Revoking ${role} from ${a.name}`, async () => {
        await authed(`${path}/${role}`, { method: "DELETE" });
        return `${a.name} is no longer a ${role}.`;
      });
    }
    return attempt(`Granting ${role} to ${a.name}`, async () => {
      await authed(path, { method: "POST", body: { role } });
      await refresh();
      await loadQuota();
      return `${a.name} is a ${role} now.`;
    });
  }

  function saveQuota() {
    const a = selected();
    const body = {};
    QUOTA.forEach(([key], i) => {
      const text = quotaInputs[i].value.trim();
      const n = Number(text);
      body[key] = text === "" ? null : Number.isSafeInteger(n) ? n : text; // text: the server says why
    });
    return attempt(`Setting ${a.name}'s quota`, async () => {
      await authed(`/contributors/${encodeURIComponent(a.id)}/quota`, { method: "PUT", body });
      await loadQuota();
      return `${a.name}'s quota is set.`;
    });
  }

  function ban() {
    const a = selected();
    return attempt(`Banning ${a.name}`, async () => {
      const b = await authed(`/contributors/${encodeURIComponent(a.id)}/ban`, { method: "POST", body: { reason: banReason.value.trim() } });
      banReason.value = "";
      return `${a.name} is banned from the hub (${b.excluded} contributions left out, ${b.leases_released} leases released).`;
    });
  }

  function unban() {
    const a = selected();
    return attempt(`Lifting ${a.name}'s ban`, async () => {
      await authed(`/contributors/${encodeURIComponent(a.id)}/unban`, { method: "POST" });
      return `${a.name}'s token works again.`;
    });
  }

  function unquarantine() {
    const a = selected();
    return attempt(`Lifting ${a.name}'s quarantine`, async () => {
      await authed(`/contributors/${encodeURIComponent(a.id)}/unquarantine`, { method: "POST" });
      return `${a.name}'s uploads count again.`;
    });
  }

  // ------------------------------------------------------------ the list
  function renderList() {
    const json = JSON.stringify([state.accounts, state.total, state.offset, state.selected]);
    if (json === state.shown) return;
    state.shown = json;
    const pager = state.total > PAGE ? h("div", { class: "toolbar" },
      h("button", { type: "button", text: "Newer", disabled: state.offset === 0,
        onclick: () => { state.offset = Math.max(0, state.offset - PAGE); refresh(); } }),
      h("button", { type: "button", text: "Older", disabled: state.offset + PAGE >= state.total,
        onclick: () => { state.offset += PAGE; refresh(); } })) : null;
    replace(list,
      h("p", { class: "muted", text: `${state.total} accounts, newest first` +
        (state.total > PAGE ? ` (${state.offset + 1}–${state.offset + state.accounts.length})` : "") }),
      table(["Name", "Roles", "Runs owned", "Standing", "Last seen", ""],
        state.accounts.map((a) => h("tr", { class: a.id === state.selected ? "selected" : "" },
          h("td", { class: "name" }, a.name, h("div", { class: "muted small", text: a.id })),
          h("td", { text: a.roles.join(", ") || "–" }),
          h("td", { text: String(a.runs_owned) }),
          h("td", { class: a.banned_at || a.quarantined_at ? "reason close-error" : "reason", text: standing(a) }),
          h("td", { text: ago(a.last_seen_at) }),
          h("td", {}, h("button", { type: "button", text: "Manage", "aria-label": `Manage ${a.name}`,
            onclick: () => select(a.id) })))),
        "Accounts"),
      pager);
  }

  async function refresh() {
    const page = await authed(`/accounts?limit=${PAGE}&offset=${state.offset}`);
    state.accounts = page.accounts;
    state.total = page.total;
    renderList();
    renderPanel();
  }

  let stop = () => {};
  let stopped = false;
  refreshMe().then((who) => {
    if (stopped) return;
    if (!who || who.error || who.kind !== "admin") {
      const why = !who ? "you are not signed in" : who.error ? `the hub refused your token: ${who.error}`
        : `you are signed in as ${who.name}, not as the admin`;
      replace(list, h("p", { id: "admin-denied" }, `This page needs the hub's admin token: ${why}. `,
        h("a", { href: "#/account", text: "Sign in" })));
      ready();
      return;
    }
    stop = poll(refresh, 5000);
  });
  return () => { stopped = true; stop(); };
}
