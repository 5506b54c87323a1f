// The dashboard: a hash router over its pages, each polling the JSON API while visible.
//   #/runs            every run: status, owner, round, contributors, last eval loss, sparkline
//   #/runs/<id>       one run: its owner's controls, the live round, charts, rounds, contributions
//   #/new             create a run (a run owner or the admin)
//   #/contributors    the leaderboard
//   #/join            the install command for this server
//   #/account         sign in with a token (kept in this tab only), sign out
//   #/admin           accounts, roles, quotas, hub bans (the admin)

import { ago, api, h, int, num, replace, si } from "./dom.js";
import { sparkline } from "./chart.js";
import { accountPage } from "./account.js";
import { adminPage } from "./admin.js";
import { newRunPage } from "./new.js";
import { runPage } from "./run.js";
import { label, me, onChange, refreshMe } from "./session.js";
import { poll, ready, showNotice, statusBadge, table } from "./ui.js";

const main = document.getElementById("app");

// ---------------------------------------------------------------- runs

function runsPage() {
  const list = h("div", { class: "runs" });
  replace(main, h("h1", { text: "Runs" }), list);
  return poll(async () => {
    const { runs } = await api("/runs");
    const recent = runs.slice(0, 20);
    const rounds = await Promise.all(recent.map((r) => api(`/runs/${encodeURIComponent(r.id)}/rounds`)));
    if (runs.length === 0) {
      replace(list, h("p", { class: "muted" }, "No runs yet. Create one ",
        h("a", { href: "#/new", text: "here" }), " or with ",
        h("code", { text: "diloco run create CONFIG.toml --server URL" }), "."));
    } else {
      replace(list, table(
        ["Run", "Status", "Round", "Active contributors", "Eval loss", "Trend"],
        runs.map((run, i) => {
          const cur = run.current_round;
          const live = cur ? cur.leases.filter((l) => l.live && !l.contributed).length : 0;
          const evals = (rounds[i] ? rounds[i].rounds : [])
            .filter((r) => r.state === "closed" && r.eval_loss !== null).map((r) => r.eval_loss);
          return h("tr", {},
            h("td", {}, h("a", { href: `#/runs/${encodeURIComponent(run.id)}`, text: run.name }),
              h("div", { class: "muted small", text: run.owner ? `${run.id} · ${run.owner.name}'s` : run.id })),
            h("td", {}, statusBadge(run.status)),
            // fresh work of quorum (late merges count in accepted, never towards quorum)
            h("td", { text: cur ? `${cur.index} (${cur.accepted - (cur.late || 0)}/${cur.quorum}${cur.late ? ` + ${cur.late} late` : ""})` : "–" }),
            h("td", { text: cur ? String(cur.leases.filter((l) => l.live || l.contributed).length) : "0",
              title: `${live} training now` }),
            h("td", { text: run.latest && run.latest.eval_loss === null ? "pending" : num(run.latest ? run.latest.eval_loss : null) }),
            h("td", {}, sparkline(evals, `eval loss of ${run.name} over ${evals.length} rounds`)));
        }),
      ));
    }
  });
}

// ---------------------------------------------------------------- contributors

function contributorsPage() {
  const sort = h("select", { id: "lb-sort", onchange: () => refreshNow() },
    ["credit", "tokens", "accepted", "last_seen", "name"].map((k) => h("option", { value: k, text: k.replace("_", " ") })));
  const board = h("div", {});
  replace(main, h("h1", { text: "Contributors" }),
    h("p", { class: "muted" }, "Credit is the training compute that went into outer steps: tokens × 6 × parameters. "
      + "Where a run audits its work, credit is pending until an audit of the contributor's work replays it, "
      + "and counts (and ranks) once confirmed."),
    h("div", { class: "toolbar" }, h("label", { for: "lb-sort", text: "Sort by " }), sort),
    board);
  async function refresh() {
    const lb = await api(`/contributors?sort=${encodeURIComponent(sort.value)}&limit=200`);
    replace(board,
      h("p", { class: "muted", text: `${lb.total} contributors` }),
      table(["#", "Name", "Credit", "Pending an audit", "Accepted", "Aggregated", "Tokens", "Last seen", "Device"],
        lb.contributors.map((c) => h("tr", {},
          h("td", { text: String(c.rank) }),
          h("td", { class: "name", text: c.name }),
          h("td", { text: si(c.credit, "FLOP") }),
          h("td", { class: "muted", text: c.pending_credit ? si(c.pending_credit, "FLOP") : "–" }),
          h("td", { text: int(c.accepted) }),
          h("td", { text: int(c.aggregated) }),
          h("td", { text: si(c.tokens) }),
          h("td", { text: ago(c.last_seen_at) }),
          h("td", { text: c.device || "–" }))),
        "Leaderboard"));
  }
  const refreshNow = () => refresh().catch((err) => showNotice(err.message));
  return poll(refresh, 5000);
}

// ---------------------------------------------------------------- join

function joinPage() {
  const body = h("div", {});
  replace(main, h("h1", { text: "Join a run" }), body);
  return poll(async () => {
    const [hub, { runs }] = await Promise.all([api("/hub"), api("/runs")]);
    const active = runs.filter((r) => r.status === "active");
    const command = h("code", { id: "install-command", text: hub.install_command });
    const copy = h("button", { type: "button", text: "Copy command", onclick: async () => {
      try {
        await navigator.clipboard.writeText(hub.install_command);
        copy.textContent = "Copied";
      } catch {
        copy.textContent = "Select the text to copy";
      }
    } });
    replace(body,
      h("p", {}, "Run this one line on a machine with Python 3.11 or newer (a GPU helps, a CPU works):"),
      h("pre", { class: "command" }, command), copy,
      h("h2", { text: "What it does" }),
      h("ol", {},
        h("li", { text: `Creates a Python environment under ~/.diloco (or $DILOCO_HOME) and installs torch and the DiLoCo Hub client ${hub.version}, the wheel this server serves, checked against its sha256.` }),
        h("li", { text: "Registers you as a contributor under the name you give and keeps your token in its config folder (only its hash is stored on the server)." }),
        h("li", {}, "Prints the command that starts contributing: ", h("code", { text: hub.join_command }),
          ". It downloads the current model, trains a round on your machine and uploads the compressed update; stop it at any time with Ctrl-C.")),
      h("p", { class: "muted" }, "Options: --device cpu|cuda|mps, --run ID, --start. Run the script again to upgrade."),
      h("h2", { text: "Active runs" }),
      active.length
        ? h("ul", {}, active.map((r) => h("li", {}, h("a", { href: `#/runs/${encodeURIComponent(r.id)}`, text: r.name }), ` (${r.id})`)))
        : h("p", { class: "muted", text: "No active run right now: the client waits for one." }));
  }, 15000);
}

// ---------------------------------------------------------------- router

const ROUTES = [
  [/^#\/runs\/([A-Za-z0-9_-]{1,32})$/, (m) => runPage(main, m[1])],
  [/^#\/runs$/, runsPage],
  [/^#\/new$/, () => newRunPage(main)],
  [/^#\/contributors$/, contributorsPage],
  [/^#\/join$/, joinPage],
  [/^#\/account$/, () => accountPage(main, previous)],
  [/^#\/admin$/, () => adminPage(main)],
];

let stopPage = null;
let previous = null; // the page before this one: the account page links back to it
let current = null;

// the header names who is signed in; the admin's page is in the menu for the admin only
function renderIdentity() {
  const who = me();
  const link = document.getElementById("whoami");
  link.textContent = who ? label(who) : who === null ? "Sign in" : "…";
  link.title = who && !who.error ? "your account; sign out there" : "sign in with a token";
  document.getElementById("nav-admin").hidden = !(who && who.kind === "admin");
}

function route() {
  if (stopPage) stopPage();
  stopPage = null;
  delete document.body.dataset.ready;
  showNotice(null);
  const hash = location.hash || "#/runs";
  if (hash !== current) [previous, current] = [current, hash];
  if (hash !== "#/account") refreshMe(); // a role may have been granted or revoked meanwhile
  for (const link of document.querySelectorAll("header a[href^='#/']:not(.brand)")) {
    const here = hash === link.getAttribute("href") || hash.startsWith(`${link.getAttribute("href")}/`);
    if (here) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  for (const [pattern, page] of ROUTES) {
    const m = hash.match(pattern);
    if (m) {
      stopPage = page(m);
      return;
    }
  }
  replace(main, h("h1", { text: "Not found" }),
    h("p", {}, "No such page. ", h("a", { href: "#/runs", text: "All runs" })));
  ready();
}

onChange(renderIdentity);
renderIdentity();
window.addEventListener("hashchange", route);
route();
