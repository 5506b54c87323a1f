// #/account: sign in with a token (kept for this tab only), see what it may do, sign out.

import { h, int, replace, si } from "./dom.js";
import { label, me, refreshMe, signIn, signOut } from "./session.js";
import { ready } from "./ui.js";

function quotaText(q) {
  const e = q.effective;
  return `${q.runs_not_ended} of ${int(e.runs)} runs not ended; at most ${si(e.params)} parameters ` +
    `and ${si(e.data_bytes, "B")} of data a run`;
}

export function accountPage(main, back) {
  const input = h("input", { id: "token", type: "password", autocomplete: "off", spellcheck: "false",
    placeholder: "adm_… or ctr_…" });
  const msg = h("p", { class: "control-msg", role: "status", "aria-live": "polite" });
  const identityBox = h("div", { id: "identity" });
  const form = h("form", { class: "token", onsubmit: (e) => { e.preventDefault(); submit(); } },
    h("label", { for: "token", text: "Token" }), input,
    h("button", { type: "submit", text: "Sign in" }));
  replace(main, h("h1", { text: "Account" }),
    h("p", { class: "muted" }, "Sign in with the hub's admin token or your contributor token (",
      h("code", { text: "diloco" }), "'s client keeps it in its config folder). It is kept in this tab only ",
      "and forgotten when the tab closes."),
    form, msg, identityBox);

  function render() {
    const who = me();
    if (who === null) {
      replace(identityBox, h("p", { class: "muted", text: "Not signed in." }));
      return;
    }
    if (who === undefined) {
      replace(identityBox, h("p", { class: "muted", text: "Checking the token…" }));
      return;
    }
    const out = h("button", { type: "button", text: "Sign out", onclick: () => {
      signOut();
      msg.textContent = "Signed out: the token is forgotten.";
      render();
    } });
    if (who.error) {
      replace(identityBox, h("p", { class: "close-error", text: `The hub refuses the token this tab keeps: ${who.error}` }), out);
      return;
    }
    const rows = [
      ["Signed in as", who.kind === "admin" ? "the hub's admin" : who.name],
      ["Id", who.id || "–"],
      ["Roles", who.roles.length ? who.roles.join(", ") : "none (a volunteer)"],
      ["Creates runs", who.can_create_runs ? "yes" : "no: the hub's admin grants the owner role"],
      who.quota ? ["Quota", quotaText(who.quota)] : null,
    ].filter(Boolean);
    replace(identityBox,
      h("dl", { class: "facts" }, rows.flatMap(([k, v]) => [h("dt", { text: k }), h("dd", { text: v })])),
      h("p", {},
        who.can_create_runs ? h("a", { href: "#/new", text: "Create a run" }) : null,
        who.kind === "admin" ? [" · ", h("a", { href: "#/admin", text: "Accounts and roles" })] : null,
        back ? [who.can_create_runs ? " · " : "", h("a", { href: back, text: "Back to where you were" })] : null),
      out);
  }

  async function submit() {
    const value = input.value.trim();
    if (!value) {
      msg.textContent = "Enter a token first.";
      return;
    }
    msg.textContent = "Checking the token…";
    try {
      const who = await signIn(value);
      input.value = "";
      msg.textContent = `Signed in as ${label(who)}.`;
    } catch (err) {
      msg.textContent = `The hub refused this token: ${err.message}`;
    }
    render();
  }

  let stopped = false;
  render();
  refreshMe().then(() => {
    if (stopped) return;
    render();
    ready();
  });
  return () => { stopped = true; };
}
