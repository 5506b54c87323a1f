// Who is signed in: the one token store of the dashboard. The token lives in this tab's
// sessionStorage only (never localStorage or a cookie): it is gone when the tab closes.
// ``me()`` is what GET /whoami says of it: the admin, or a contributor with its roles.

import { api } from "./dom.js";

const TOKEN_KEY = "diloco.token";
// the last /whoami answer; {error} when the hub refused the token; undefined until known
let identity;
let pending = null; // the /whoami request in flight: {asked (its token), answer}
const listeners = new Set();

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

/** The last known identity: null when signed out; undefined while /whoami is asked;
 * ``{error}`` when the hub refused the token (a rotated or banned one); else /whoami's. */
export function me() {
  return token() ? identity : null;
}

/** ``api`` with this tab's token. */
export function authed(path, options = {}) {
  return api(path, { ...options, token: token() });
}

/** Asks /whoami again (the admin may have granted or revoked a role meanwhile). */
export function refreshMe() {
  const asked = token();
  if (!asked) {
    set(null);
    return Promise.resolve(null);
  }
  if (pending && pending.asked === asked) return pending.answer;
  const answer = api("/whoami", { token: asked })
    .then((who) => who, (err) => ({ error: err.message, status: err.status }))
    .then((who) => {
      if (pending && pending.answer === answer) pending = null;
      return token() === asked ? set(who) : me(); // signed in or out meanwhile: stale
    });
  pending = { asked, answer };
  return answer;
}

/** Keeps ``value`` for this tab if the hub knows it; throws the hub's refusal otherwise. */
export async function signIn(value) {
  const who = await api("/whoami", { token: value });
  sessionStorage.setItem(TOKEN_KEY, value);
  pending = null;
  return set(who);
}

export function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  pending = null;
  set(null);
}

/** Calls ``fn(identity)`` on every change; returns the unsubscriber. */
export function onChange(fn) {
  listeners.add(fn);
  return () => listeners.delete(fn);
}

function set(value) {
  identity = value;
  for (const fn of listeners) fn(value);
  return value;
}

/** How the header names the signed-in token: "admin", "alice · owner". */
export function label(who) {
  if (!who) return "";
  if (who.error) return "token refused";
  if (who.kind === "admin") return "admin";
  return who.roles.length ? `${who.name} · ${who.roles.join(", ")}` : who.name;
}

/** Why ``who`` may not manage ``run`` (its owner or the admin may), or null when it may. */
export function cannotManage(who, run) {
  if (who === undefined) return "checking the token you signed in with";
  if (!who) return "sign in as this run's owner or the hub's admin to use this";
  if (who.error) return `the hub refused the token you signed in with: ${who.error}`;
  if (who.kind === "admin") return null;
  if (!run.owner || run.owner.id !== who.id) {
    const whose = run.owner ? `${run.owner.name}'s` : "the hub admin's";
    return `this run is ${whose}: only its owner and the hub's admin manage it`;
  }
  if (!who.roles.includes("owner")) return "your owner role was revoked: the hub's admin manages your runs now";
  return null;
}

/** Why ``who`` may not create runs, or null when it may. */
export function cannotCreate(who) {
  if (who === undefined) return "checking the token you signed in with";
  if (!who) return "sign in with a run owner's token or the admin's to create a run";
  if (who.error) return `the hub refused the token you signed in with: ${who.error}`;
  if (!who.can_create_runs) return "your account is not a run owner: the hub's admin grants that role";
  const q = who.quota;
  if (q && q.runs_not_ended >= q.effective.runs) {
    return `your quota allows ${q.effective.runs} runs not ended at once and you have ${q.runs_not_ended}: end one, or ask the admin for more`;
  }
  return null;
}
