// A run's controls: pause, resume, cancel; private with an invite, or public; bans from
// the run; export. What only the run's owner and the hub's admin may do is disabled with
// the reason (in its title, and said once in words) when the signed-in token cannot.

import { api, h, replace, when } from "./dom.js";
import { authed, cannotManage, label, me, onChange } from "./session.js";
import { table } from "./ui.js";

// action, button text, the statuses it applies to, why not in another status
const ACTIONS = [
  ["pause", "Pause", ["active"], "only an active run can be paused"],
  ["resume", "Resume", ["paused"], "only a paused run can be resumed"],
  ["cancel", "Cancel run", ["active", "paused"], "the run has ended"],
];
const ENDED = ["completed", "cancelled"];

let hubInfo = null; // GET /hub: this server's public address, for the export command

/** Enables ``el`` or disables it with ``why`` as its title. */
function allow(el, why) {
  el.disabled = Boolean(why);
  if (why) el.title = why;
  else el.removeAttribute("title");
}

/** The controls of run ``runId``: ``{el, exportEl, update(run), seen(id, name), stop()}``.
 * ``onRun(run)``: an action answered with the run's new state. */
export function runControls(runId, { onRun }) {
  const path = `/runs/${encodeURIComponent(runId)}`;
  let run = null;
  let bansLoadedFor = null; // the identity the listed bans were loaded for
  const seen = new Map(); // contributor id -> name, from the run's leases and contributions

  const owner = h("p", { id: "run-owner" });
  const who = h("p", { id: "control-who", class: "muted" });
  const msg = h("p", { class: "control-msg", role: "status", "aria-live": "polite" });
  const buttons = ACTIONS.map(([action, text]) =>
    h("button", { type: "button", class: `action ${action}`, text, onclick: () => act(action) }));

  const privacy = h("p", { id: "run-privacy" });
  const inviteButton = h("button", { type: "button", text: "Make private with a new invite", onclick: invite });
  const publicButton = h("button", { type: "button", text: "Make public", onclick: makePublic });
  const inviteBox = h("div", { id: "invite-box" });

  const banWho = h("input", { id: "ban-contributor", list: "run-contributors", autocomplete: "off",
    spellcheck: "false", placeholder: "ctr_…", oninput: () => renderBanForm() });
  const banOptions = h("datalist", { id: "run-contributors" });
  const banReason = h("input", { id: "ban-reason", maxlength: 500, autocomplete: "off", oninput: () => renderBanForm() });
  const banButton = h("button", { type: "submit", text: "Ban from this run" });
  const banForm = h("form", { class: "token", onsubmit: (e) => { e.preventDefault(); ban(); } },
    h("label", { for: "ban-contributor", text: "Contributor" }), banWho, banOptions,
    h("label", { for: "ban-reason", text: "Reason" }), banReason, banButton);
  const bansBox = h("div", { id: "run-bans" });
  const exportBox = h("div", { id: "run-export" });

  const el = [owner, who, h("div", { class: "actions" }, buttons),
    h("h3", { text: "Who may join" }), privacy,
    h("div", { class: "actions" }, inviteButton, publicButton), inviteBox,
    h("h3", { text: "Bans from this run" }), banForm, bansBox, msg];

  // ------------------------------------------------------------ rendering
  function reasons() {
    return {
      denied: cannotManage(me(), run),
      ended: ENDED.includes(run.status) ? `the run is ${run.status}` : null,
    };
  }

  function renderBanForm() {
    if (!run) return;
    const { denied, ended } = reasons();
    const missing = !banWho.value.trim() ? "enter a contributor id"
      : !banReason.value.trim() ? "give a reason: the contributor is told it" : null;
    for (const input of [banWho, banReason]) allow(input, denied || ended);
    allow(banButton, denied || ended || missing);
  }

  function render() {
    if (!run) return;
    const identity = me();
    const { denied, ended } = reasons();

    replace(owner, run.owner
      ? ["Owner: ", h("strong", { class: "name", text: run.owner.name }), ` (${run.owner.id})`]
      : ["Owner: the hub's admin"]);
    if (denied) {
      replace(who, `${denied[0].toUpperCase()}${denied.slice(1)}.`,
        identity === null ? [" ", h("a", { href: "#/account", text: "Sign in" })] : "");
    } else {
      replace(who, `Signed in as ${label(identity)}: you manage this run.`);
    }
    ACTIONS.forEach(([, , statuses, why], i) => {
      allow(buttons[i], denied || (statuses.includes(run.status) ? null : `${why} (it is ${run.status})`));
    });

    privacy.textContent = run.private
      ? "Private: joining needs the invite code. A new invite replaces the old code; members stay."
      : "Public: anyone may join.";
    allow(inviteButton, denied || ended);
    allow(publicButton, denied || ended || (run.private ? null : "the run is public already"));

    renderBanForm();
    if (denied) {
      bansLoadedFor = null;
      replace(bansBox, h("p", { class: "muted", text: "The run's bans are shown to its owner and the hub's admin." }));
    } else if (bansLoadedFor !== identity) {
      bansLoadedFor = identity;
      loadBans().catch((err) => { msg.textContent = `Could not list the bans: ${err.message}`; });
    }
  }

  function renderExport() {
    const server = hubInfo ? hubInfo.public_url : location.origin;
    const command = `diloco run export ${runId} --server ${server} --out ${runId}-model`;
    replace(exportBox,
      run && run.checkpoint_version > 0 ? null
        : h("p", { class: "muted", text: "No round has closed yet: the latest checkpoint is the starting model." }),
      h("p", {}, h("a", { id: "checkpoint-link", href: `/api/v1${path}/checkpoints/latest`, download: "",
        text: "Download the latest checkpoint" }), " (safetensors; anyone may)."),
      h("p", { text: "As a Hugging Face model directory:" }),
      h("pre", { class: "command" }, h("code", { id: "export-command", text: command })));
  }

  async function loadBans() {
    const { bans } = await authed(`${path}/bans`);
    replace(bansBox, bans.length
      ? table(["Contributor", "Reason", "By", "Since", ""],
        bans.map((b) => h("tr", {},
          h("td", { class: "name" }, b.contributor_name, h("div", { class: "muted small", text: b.contributor_id })),
          h("td", { class: "reason", text: b.reason }),
          h("td", { text: b.banned_by }),
          h("td", { text: when(b.banned_at) }),
          h("td", {}, h("button", { type: "button", text: "Lift", "aria-label": `Lift the ban of ${b.contributor_name}`,
            onclick: () => lift(b) })))),
        "Banned from this run: their joins and uploads here are refused with the reason")
      : h("p", { class: "muted", text: "Nobody is banned from this run." }));
  }

  // ------------------------------------------------------------ actions
  async function attempt(doing, work) {
    msg.textContent = `${doing}…`;
    try {
      msg.textContent = await work();
    } catch (err) {
      msg.textContent = `${doing} failed: ${err.message}`;
    }
  }

  function act(action) {
    if (action === "cancel" && !window.confirm("Cancel this run for good?")) return;
    return attempt(action, async () => {
      onRun(await authed(`${path}/${action}`, { method: "POST" }));
      return `Run is ${run.status}.`;
    });
  }

  function invite() {
    return attempt("Making the run private", async () => {
      const answer = await authed(`${path}/invite`, { method: "POST" });
      const server = hubInfo ? hubInfo.public_url : location.origin;
      replace(inviteBox,
        h("p", {}, "Invite code, shown this once: ", h("code", { id: "invite-code", text: answer.invite })),
        h("p", { class: "muted" }, "A volunteer joins with ",
          h("code", { text: `diloco join ${server} --run ${runId} --invite ${answer.invite}` }), "."));
      onRun(await api(path));
      return "The run is private: hand the code to whom may join.";
    });
  }

  function makePublic() {
    return attempt("Making the run public", async () => {
      await authed(`${path}/invite`, { method: "DELETE" });
      replace(inviteBox);
      onRun(await api(path));
      return "The run is public: anyone may join.";
    });
  }

  function ban() {
    const id = banWho.value.trim();
    return attempt(`Banning ${id}`, async () => {
      const b = await authed(`${path}/bans`, { method: "POST", body: { contributor_id: id, reason: banReason.value.trim() } });
      banWho.value = "";
      banReason.value = "";
      renderBanForm();
      await loadBans();
      return `${b.contributor_name} is banned from this run (${b.excluded} unfinished contributions left out, ${b.released} leases released).`;
    });
  }

  function lift(b) {
    return attempt(`Lifting the ban of ${b.contributor_name}`, async () => {
      await authed(`${path}/bans/${encodeURIComponent(b.contributor_id)}`, { method: "DELETE" });
      await loadBans();
      return `${b.contributor_name} may join this run again.`;
    });
  }

  for (const el of [...buttons, inviteButton, publicButton, banWho, banReason, banButton]) allow(el, "loading the run");
  const unsubscribe = onChange(() => render());
  if (!hubInfo) api("/hub").then((hub) => { hubInfo = hub; renderExport(); }, () => {});
  renderExport();
  const controls = {
    el,
    exportEl: exportBox,
    update(next) {
      const versionChanged = !run || run.checkpoint_version !== next.checkpoint_version;
      run = next;
      render();
      if (versionChanged) renderExport();
    },
    /** A contributor seen in the run's rounds, offered in the ban form. */
    seen(id, name) {
      if (seen.get(id) === name) return;
      seen.set(id, name);
      banOptions.append(h("option", { value: id, text: name }));
    },
    stop: unsubscribe,
  };
  // everyone the run ever took work from (the leaderboard of this run), besides the leases
  // and contributions the page shows
  api(`/contributors?run=${encodeURIComponent(runId)}&limit=1000`).then(
    (board) => { for (const c of board.contributors) controls.seen(c.id, c.name); }, () => {});
  return controls;
}
