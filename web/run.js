// One run: its controls, the live round, loss charts, tokens/s, rounds and contributions.

import { ago, api, duration, h, int, num, replace, serverNow, si, when } from "./dom.js";
import { lineChart } from "./chart.js";
import { runControls } from "./run_controls.js";
import { poll, statusBadge, table } from "./ui.js";

function section(title, ...children) {
  return h("section", { "aria-label": title }, h("h2", { text: title }), ...children);
}

/** Tokens per second of a closed round, from its opening to its close. */
function tokensPerSecond(r) {
  const s = (Date.parse(r.closed_at) - Date.parse(r.opened_at)) / 1000;
  return r.closed_at && s > 0 ? r.tokens / s : null;
}

export function runPage(main, runId) {
  const path = `/runs/${encodeURIComponent(runId)}`;
  const last = new Map(); // section -> the JSON it was last rendered from
  const state = { run: null, rounds: [], axis: "round", selected: null, follow: true };
  const changed = (key, value) => {
    const json = JSON.stringify(value);
    if (last.get(key) === json) return false;
    last.set(key, json);
    return true;
  };

  // ------------------------------------------------------------ skeleton
  const title = h("h1", { text: runId });
  const meta = h("p", { class: "muted" });
  const controls = runControls(runId, { onRun: (run) => { state.run = run; renderRun(); } });
  const roundBox = h("div", { class: "round" });
  const stats = h("dl", { class: "stats" });
  const axisButtons = [["round", "By round"], ["tokens", "By tokens"]].map(([axis, text]) =>
    h("button", { type: "button", "aria-pressed": String(axis === state.axis), text, onclick: () => { state.axis = axis; renderChart(true); } }));
  const chartBox = h("div", { class: "chart-box" });
  const roundsBox = h("div", {});
  const contribBox = h("div", {});
  const contribTitle = h("h2", { text: "Contributions" });
  const configBox = h("pre", { class: "config" });

  replace(main,
    h("div", { class: "run-head" }, title, h("span", { id: "run-status" })), meta,
    section("Controls", controls.el),
    section("Current round", roundBox),
    section("Throughput", stats),
    section("Loss", h("div", { class: "toolbar", role: "group", "aria-label": "x axis" }, axisButtons),
      chartBox,
      h("p", { class: "legend muted" }, h("span", { class: "key eval" }), "eval loss of the checkpoint a round produced  ",
        h("span", { class: "key train" }), "mean train loss of its contributions")),
    section("Rounds", roundsBox),
    h("section", { "aria-label": "Contributions" }, contribTitle, contribBox),
    section("Export", controls.exportEl),
    h("section", { "aria-label": "Run config" }, h("details", {}, h("summary", { text: "Run config" }), configBox)));

  // ------------------------------------------------------------ the run and its round
  function renderRun() {
    const run = state.run;
    const data = run.data;
    if (changed("head", [run.name, run.status, run.checkpoint_version, data.tokens_trained])) {
      title.textContent = run.name;
      document.title = `${run.name} · DiLoCo Hub`;
      replace(document.getElementById("run-status"), statusBadge(run.status));
      // coverage: what the accepted contributions trained on, in tokens and epochs
      const source = data.dataset_id ? `dataset ${data.dataset_id}` : "text file";
      meta.textContent = `${run.id} · created ${when(run.created_at)} · ${si(run.n_params)} parameters · ` +
        `checkpoint version ${run.checkpoint_version} · ${si(data.train_tokens)} training tokens (${source}) · ` +
        `${si(data.tokens_trained)} tokens trained, ${data.epochs.toFixed(2)} epochs`;
    }
    if (changed("controls", [run.status, run.private, run.owner, run.checkpoint_version])) controls.update(run);
    if (changed("config", run.config)) configBox.textContent = JSON.stringify(run.config, null, 2);
    const cur = run.current_round;
    for (const l of cur ? cur.leases : []) controls.seen(l.contributor_id, l.contributor_name);
    if (!changed("round", [cur, run.status])) return;
    if (!cur) {
      replace(roundBox, h("p", { class: "muted", text: `No round in progress: the run is ${run.status}.` }));
      return;
    }
    // accepted: the contributions in the round's step so far, late merges included; the
    // bar shows the fresh ones, the only ones quorum and target count
    const late = cur.late || 0;
    const fresh = cur.accepted - late;
    const max = Math.max(cur.target || cur.quorum, fresh, 1);
    const fill = h("div", { class: "fill" });
    fill.style.width = `${(100 * Math.min(fresh, max)) / max}%`;
    const mark = h("div", { class: "quorum", title: `quorum ${cur.quorum}` });
    mark.style.left = `${(100 * cur.quorum) / max}%`;
    const lateNote = late ? ` (${late} late, not counted towards quorum)` : "";
    const label = `${cur.accepted} accepted${lateNote} · quorum ${cur.quorum} · target ${cur.target ?? "none"}`;
    const leases = cur.leases.map((l) => h("tr", {},
      h("td", { class: "name", text: l.contributor_name }),
      h("td", { text: String(l.shard) }),
      h("td", { "data-since": l.last_heartbeat, text: ago(l.last_heartbeat) }),
      h("td", { text: (l.last_step === null ? "–" : String(l.last_step)) + (l.inner_steps ? ` / ${l.inner_steps}` : "") }),
      h("td", { text: num(l.last_loss) }),
      h("td", {}, h("span", { class: `badge ${l.contributed ? "done" : l.live ? "live" : "lapsed"}`,
        text: l.contributed ? "contributed" : l.live ? "training" : "lapsed" }))));
    replace(roundBox,
      h("p", { class: "round-title" }, h("strong", { text: `Round ${cur.index}` }), ` · ${cur.state} · trains from version ${cur.index - 1}`),
      h("div", { id: "round-progress", class: "progress", role: "progressbar", "aria-label": `Accepted contributions in round ${cur.index}`,
        "aria-valuemin": 0, "aria-valuemax": max, "aria-valuenow": fresh, "aria-valuetext": label }, fill, mark),
      h("p", { id: "round-progress-text", text: label }),
      h("p", {}, "Deadline: ", h("span", { id: "countdown", "data-deadline": cur.deadline }), ` (${when(cur.deadline)})`),
      h("p", { class: "muted", text: cur.reason || "" }),
      cur.error ? h("p", { id: "round-error", class: "close-error", role: "status",
        text: `Close attempt ${cur.error.attempts} failed (${cur.error.code}): ${cur.error.detail}` +
          (cur.error.retry_at ? ` · retrying ${when(cur.error.retry_at)}` : "") }) : null,
      cur.leases.length
        ? table(["Contributor", "Shard", "Last heartbeat", "Step", "Loss", "State"], leases, "Leases on this round")
        : h("p", { class: "muted", text: "Nobody holds a lease on this round yet." }));
    tick();
  }

  /** Once a second: the countdown and the heartbeat ages, without asking the server. */
  function tick() {
    const countdown = document.getElementById("countdown");
    if (countdown && state.run) {
      const left = (Date.parse(countdown.dataset.deadline) - serverNow()) / 1000;
      countdown.textContent = state.run.status !== "active" ? `stopped (run ${state.run.status})`
        : left >= 0 ? `${duration(left)} left` : `passed ${duration(-left)} ago`;
    }
    for (const cell of main.querySelectorAll("td[data-since]")) cell.textContent = ago(cell.dataset.since);
  }

  // ------------------------------------------------------------ rounds, throughput, charts
  function closedRounds() {
    return state.rounds.filter((r) => r.state === "closed");
  }

  function renderStats() {
    const closed = closedRounds();
    const total = closed.reduce((acc, r) => acc + r.tokens, 0);
    const lastRate = closed.length ? tokensPerSecond(closed[closed.length - 1]) : null;
    const span = closed.length ? (Date.parse(closed[closed.length - 1].closed_at) - Date.parse(closed[0].opened_at)) / 1000 : 0;
    const item = (k, v, id) => [h("dt", { text: k }), h("dd", { id, text: v })];
    replace(stats,
      item("tokens/s, last round", lastRate === null ? "–" : si(lastRate), "tps-last"),
      item("tokens/s, whole run", span > 0 ? si(total / span) : "–", "tps-run"),
      item("tokens aggregated", si(total)),
      item("rounds closed", `${closed.length} of ${state.run ? state.run.config.rounds.max_rounds : "?"}`));
  }

  function renderChart(force = false) {
    axisButtons.forEach((b, i) => b.setAttribute("aria-pressed", String(["round", "tokens"][i] === state.axis)));
    const closed = closedRounds();
    if (!changed("chart", [closed.map((r) => [r.index, r.tokens, r.eval_loss, r.train_loss]), state.axis]) && !force) return;
    let cumulative = 0;
    const xs = closed.map((r) => { cumulative += r.tokens; return state.axis === "round" ? r.index : cumulative; });
    const points = (key) => closed.map((r, i) => ({ x: xs[i], y: r[key], round: r.index })).filter((p) => p.y !== null);
    replace(chartBox, lineChart({
      title: `Loss by ${state.axis}`,
      xLabel: state.axis === "round" ? "round" : "tokens aggregated",
      yLabel: "loss",
      series: [
        { name: "eval loss", key: "eval", points: points("eval_loss") },
        { name: "mean train loss", key: "train", points: points("train_loss") },
      ],
    }));
  }

  function renderRounds() {
    if (!changed("rounds", state.rounds)) return;
    renderStats();
    renderChart();
    const rows = state.rounds.slice().reverse().map((r) => {
      const rate = r.state === "closed" ? tokensPerSecond(r) : null;
      return h("tr", { class: r.index === state.selected ? "selected" : "" },
        h("td", {}, h("button", { type: "button", class: "link", "aria-label": `Contributions of round ${r.index}`,
          text: String(r.index), onclick: () => { state.follow = false; select(r.index); } })),
        h("td", { text: r.state }),
        // late work (trained for an earlier round, merged here discounted) counts in accepted
        h("td", { text: r.late ? `${r.accepted} (${r.late} late)` : String(r.accepted) }),
        h("td", { text: si(r.tokens) }),
        h("td", { text: rate === null ? "–" : si(rate) }),
        h("td", { text: num(r.train_loss) }),
        // a closed round's eval loss is measured after its version is published
        h("td", { class: r.state === "closed" && r.eval_loss === null ? "pending" : "",
          text: r.state === "closed" && r.eval_loss === null ? "pending" : num(r.eval_loss) }),
        h("td", { text: num(r.update_norm) }),
        h("td", { text: r.closed_at ? duration((Date.parse(r.closed_at) - Date.parse(r.opened_at)) / 1000) : "–" }),
        h("td", { class: "reason" }, r.close_reason || "",
          r.error ? h("span", { class: "close-error", text: ` · ${r.close_attempts} attempts; last failure: ${r.error.code}: ${r.error.detail}` }) : null));
    });
    replace(roundsBox, table(
      ["Round", "State", "Accepted", "Tokens", "Tokens/s", "Train loss", "Eval loss", "Update norm", "Took", "Close reason"],
      rows, "Newest first; pick a round to see its contributions"));
  }

  // ------------------------------------------------------------ a round's contributions
  async function select(index) {
    state.selected = index;
    last.delete("rounds"); // re-mark the selected row
    renderRounds();
    await refreshContributions(true);
  }

  // what the close's checks and scoring measured: the code it failed (or "passed"), and
  // the figures behind it on hover
  // what it counts for: its claim, at most what its lease allows, divided by 1 + staleness
// for late work, times its contributor's standing (diloco.protocol.reputation); each
// reason it counts for less than its tokens is in the cell's title
function weightCell(c) {
  const standing = c.standing ?? 1;
  const why = [];
  if (c.staleness) why.push(`late by ${c.staleness}: weighed 1/${1 + c.staleness}`);
  if (standing < 1) why.push(`its contributor's standing: ${Math.round(standing * 100)}% (a new account earns its weight)`);
  if (c.weight < Math.ceil(Math.ceil(c.tokens / (1 + c.staleness)) * standing)) {
    why.push("capped at what its lease allows");
  }
  return h("td", why.length ? { class: "weighed", text: int(c.weight), title: why.join("; ") }
    : { text: int(c.weight) });
}

function checksCell(k) {
    if (!k) return { text: "–", title: "not checked yet: its round has not closed" };
    const figures = [
      `cosine to the others' median ${num(k.median_cosine, 3)}`,
      `to their aggregate ${num(k.loo_cosine, 3)}`,
      `nearest copy ${num(k.copy_cosine, 4)}${k.copy_of ? ` (${k.copy_of})` : ""}`,
      `norm ×${num(k.norm_ratio, 3)} the round's`,
      k.own_gain === null ? "not scored" : `loss gain ${num(k.own_gain, 4)} own, ${num(k.other_gain, 4)} other`,
    ].join("; ");
    return k.code ? { class: "close-error", text: k.code, title: figures } : { text: "passed", title: figures };
  }

  async function refreshContributions(force) {
    if (state.selected === null) return;
    const round = state.rounds.find((r) => r.index === state.selected);
    if (!force && round && round.state === "closed" && last.has(`contrib:${state.selected}`)) return;
    const data = await api(`${path}/rounds/${state.selected}/contributions`);
    if (data.round !== state.selected || !changed(`contrib:${data.round}`, data)) return;
    for (const c of [...data.contributions, ...data.rejections]) controls.seen(c.contributor_id, c.contributor_name);
    contribTitle.textContent = `Contributions to round ${data.round} (${data.state})`;
    replace(contribBox,
      data.contributions.length
        ? table(["Contributor", "Tokens", "Weight", "Steps", "Train loss", "Norm", "Cosine", "Clip",
          "Checks", "Accepted at", "Aggregated", "Credit"],
          data.contributions.map((c) => h("tr", {},
            h("td", { class: "name", text: c.staleness
              ? `${c.contributor_name} · late from round ${c.round}` : c.contributor_name }),
            h("td", { text: int(c.tokens) }),
            weightCell(c),
            h("td", { text: String(c.inner_steps) }),
            h("td", { text: num(c.loss) }),
            h("td", { text: num(c.norm, 4) }),
            h("td", { text: num(c.cosine, 2) }),
            // the factor the robust aggregate scaled it by: below 1, this one was bounded
            h("td", c.clip !== null && c.clip < 1 ? { class: "clipped", text: `×${num(c.clip, 3)}`, title: "bounded by the robust aggregate" }
              : { text: c.clip === null ? "–" : "×1" }),
            h("td", checksCell(c.checks)),
            h("td", { text: when(c.created_at) }),
            h("td", c.excluded ? { class: "close-error", text: `left out: ${c.excluded}` }
              : { text: c.aggregated ? "yes" : "not yet" }),
            h("td", c.credit_status === "confirmed" ? { text: si(c.credit, "FLOP") }
              : { class: "muted", text: `${si(c.credit, "FLOP")} ${c.credit_status}`,
                title: c.credit_status === "pending" ? "waiting for an audit of this contributor's work"
                  : "an audit of this contributor's work failed before it was confirmed" }))),
          "Accepted")
        : h("p", { class: "muted", text: "No accepted contributions yet." }),
      data.rejections.length
        ? table(["Contributor", "Error", "Why", "At"],
          data.rejections.map((r) => h("tr", {},
            h("td", { class: "name", text: r.contributor_name }),
            h("td", {}, h("code", { text: r.error })),
            h("td", { class: "reason", text: r.detail }),
            h("td", { text: when(r.created_at) }))),
          "Rejected uploads")
        : h("p", { class: "muted", text: "No rejected uploads." }));
  }

  // ------------------------------------------------------------ polling
  function follow(index) {
    if (!state.follow || index === null || index === state.selected) return;
    state.selected = index;
    last.delete("rounds"); // re-mark the selected row
  }

  async function refresh() {
    // the round's contributions load while the rounds do: the page is ready sooner
    const roundsAnswer = api(`${path}/rounds`);
    state.run = await api(path);
    follow(state.run.current_round ? state.run.current_round.index : null);
    const contributions = refreshContributions(false);
    renderRun();
    state.rounds = (await roundsAnswer).rounds;
    renderRounds();
    await contributions;
    if (!state.run.current_round && state.rounds.length) { // finished: show the last round
      follow(state.rounds[state.rounds.length - 1].index);
      renderRounds();
      await refreshContributions(false);
    }
  }

  const ticker = setInterval(tick, 1000);
  const stop = poll(refresh);
  return () => { stop(); clearInterval(ticker); controls.stop(); };
}
