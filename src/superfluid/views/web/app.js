"use strict";
// The superfluid browser UI. It talks to the daemon over /web/ws only: one socket for requests
// and the selected session's subscription, one for generations (a connection runs one request at
// a time, and a generation holds its connection until it ends). The token comes in the address's
// fragment (#token=...), which the browser never sends anywhere; it is kept for this tab only.

const ROLES = ["system", "user", "assistant", "tool"];
const FINISH = ["open", "end of turn", "max_tokens", "grammar", "cancelled", "error"];
const OUTCOMES = { 1: "failed", 2: "cancelled" };
const TEXT = 0, REASONING = 1, TOOL_CALL = 2;
const GREEDY = { temperature: 0, top_p: 1, min_p: 0, top_k: 0, seed: 0 };
const ESTIMATE_PX = 56; // a row's height until it is measured
const OVERSCAN = 6;
const LAST_ACTIVITY_ROWS = 100; // sessions whose last event time is fetched
const PIN_MS = 3600_000;
const LATENCIES_KEPT = 1000;

const $ = (id) => document.getElementById(id);

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function unpack(frame) {
  // A Response is {"Variant": payload}, or a bare string for one without fields.
  if (typeof frame === "string") return [frame, {}];
  const variant = Object.keys(frame)[0];
  return [variant, frame[variant]];
}

function expect(reply, variant) {
  const [got, payload] = unpack(reply);
  if (got === variant) return payload;
  throw new Error(got === "Err" ? payload.message : `expected ${variant}, got ${got}`);
}

function signIn() {
  const params = new URLSearchParams(location.hash.slice(1));
  const token = params.get("token");
  if (token) {
    sessionStorage.setItem("superfluid.token", token);
    params.delete("token");
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + (rest ? `#${rest}` : ""));
  }
  return { token: sessionStorage.getItem("superfluid.token"), session: Number(params.get("session")) || null };
}

// One WebSocket: requests are answered in order; subscription frames go to their handler by id,
// and a generation's Delta frames to the request in flight.
class Channel {
  constructor(token, name) {
    this.token = token;
    this.name = name;
    this.pending = [];
    this.subs = new Map();
    this.onclose = () => {};
  }

  open() {
    return new Promise((resolve, reject) => {
      const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/web/ws`;
      const ws = new WebSocket(url, ["superfluid.v1", `superfluid.token.${this.token}`]);
      ws.onopen = () => resolve(this);
      ws.onerror = () => reject(new Error(`the ${this.name} socket was refused`));
      ws.onclose = () => {
        for (const waiting of this.pending.splice(0)) waiting.reject(new Error("the daemon closed the socket"));
        this.onclose();
      };
      ws.onmessage = ({ data }) => this.receive(JSON.parse(data));
      this.ws = ws;
    });
  }

  receive(frame) {
    const [variant, payload] = unpack(frame);
    if (variant === "SubEvent" || variant === "SubProvisional" || variant === "SubEnded") {
      this.subs.get(payload.sub)?.(variant, payload);
    } else if (variant === "Delta") {
      this.pending[0]?.delta?.(payload.event);
    } else {
      this.pending.shift()?.resolve(frame);
    }
  }

  call(request, delta) {
    return new Promise((resolve, reject) => {
      if (this.ws.readyState !== WebSocket.OPEN) {
        reject(new Error(`the ${this.name} socket is closed`));
        return;
      }
      this.pending.push({ resolve, reject, delta });
      this.ws.send(JSON.stringify(request));
    });
  }
}

// Events folded into the rows the page shows: a message, a whole assistant turn (its
// Generated events by channel), a tool call with its results, a marker line.
class Conversation {
  constructor() {
    this.events = [];
    this.rows = [];
    this.calls = new Map(); // call id -> its row
    this.provisional = ["", "", ""]; // text ahead of its commit, by channel
  }

  get next() {
    return this.events.length ? this.events[this.events.length - 1].event_id + 1 : 0;
  }

  openTurn() {
    const last = this.rows[this.rows.length - 1];
    return last && last.type === "turn" && last.open ? last : null;
  }

  push(row) {
    row.version = 0;
    this.rows.push(row);
    return row;
  }

  touch(row) {
    row.version += 1;
    return this.rows.indexOf(row);
  }

  // Folds one committed event in; returns the indexes of the rows it changed or added.
  add(event) {
    if (this.events.length && event.event_id < this.next) return [];
    this.events.push(event);
    const [kind, body] = unpack(event.body);
    const id = event.event_id;
    const before = this.rows.length;
    let changed = null;
    const marker = (text, extra = "") => this.push({ type: "marker", text, cls: extra, first: id, last: id });
    switch (kind) {
      case "Created":
        marker(body.parent === null ? "new session" : `created under #${body.parent}`);
        break;
      case "Forked":
        marker(`forked from #${body.parent} at event ${body.fork_at}`);
        break;
      case "Rebased":
        marker(`rebased from #${body.parent} at event ${body.fork_at} (${body.edits.length} edit(s))`);
        break;
      case "Message":
        this.push({ type: "message", role: body.role, text: body.text, first: id, last: id });
        break;
      case "Appended":
        this.push({ type: "message", role: -1, text: body.text ?? `(${body.span.length} raw tokens)`, first: id, last: id });
        break;
      case "GenerationPrompt": {
        const open = this.openTurn();
        if (open && open.first === null) {
          open.first = open.last = id; // provisional text came first
          changed = open;
        } else {
          this.push(this.turn(id));
        }
        break;
      }
      case "Generated": {
        const turn = this.openTurn() ?? this.push(this.turn(id));
        const channel = Math.min(body.channel, TOOL_CALL);
        turn.parts[channel] += body.text;
        const ahead = this.provisional[channel];
        this.provisional[channel] = ahead.startsWith(body.text) ? ahead.slice(body.text.length) : "";
        turn.last = id;
        if (turn.first === null) turn.first = id;
        if (body.finish !== 0) {
          turn.open = false;
          turn.finish = body.finish;
          this.provisional = ["", "", ""];
        }
        changed = turn;
        break;
      }
      case "ToolUse":
        this.calls.set(id, this.push({ type: "tool", name: body.name, arguments: body.arguments, results: [], first: id, last: id }));
        break;
      case "ToolResult":
        changed = this.attach(body.call_id, `result: ${body.content}`, id);
        break;
      case "ToolOutcome":
        changed = this.attach(body.call_id, `${OUTCOMES[body.outcome] ?? "outcome"}: ${body.note}`, id);
        break;
      case "ToolExpired":
        changed = this.attach(body.call_id, `expired: ${body.reason}`, id);
        break;
      case "ToolParseFailure":
        marker(`a tool call did not parse: ${body.raw}`);
        break;
      case "Block":
        this.push({ type: "message", role: body.role, text: body.payload, block: body.kind, first: id, last: id });
        break;
      case "EpochBump": {
        const open = this.openTurn();
        if (open) {
          open.cut = true;
          changed = open;
        }
        const cut = open ? ": it cut the turn above, which continues below" : "";
        marker(`the daemon restarted here (epoch ${event.epoch})${cut}`, "epoch");
        break;
      }
      case "MetaUpdated":
        marker(body.archived === null ? `title: ${body.title ?? "(none)"}` : body.archived ? "archived" : "unarchived");
        break;
      case "QosSet":
        marker(`QoS class ${body.class}${body.batch_invariant ? ", batch-invariant" : ""}`);
        break;
      case "GenerationFingerprint":
        break;
      default:
        marker(`${kind} ${JSON.stringify(body)}`);
    }
    const touched = [];
    if (changed) touched.push(this.touch(changed));
    for (let i = before; i < this.rows.length; i++) touched.push(i);
    return touched;
  }

  turn(id) {
    return { type: "turn", parts: ["", "", ""], open: true, finish: 0, first: id, last: id, stats: null };
  }

  attach(call, text, id) {
    const row = this.calls.get(call);
    if (!row) return null;
    row.results.push(text);
    row.last = id;
    return row;
  }

  // Text ahead of its commit; returns the index of the row showing it.
  ahead(channel, text) {
    const turn = this.openTurn() ?? this.push({ ...this.turn(null), first: null, last: null });
    this.provisional[Math.min(channel, TOOL_CALL)] += text;
    return this.touch(turn);
  }
}

// A list that keeps in the page only the rows in view (and a few around), so a session of
// ten thousand events scrolls as lightly as one of ten.
class VirtualList {
  constructor(viewport, spacer, holder, draw) {
    Object.assign(this, { viewport, spacer, holder, draw });
    this.rows = [];
    this.heights = [];
    this.offsets = [0];
    this.shown = new Map(); // index -> {node, version}
    this.follow = true;
    this.queued = false;
    viewport.addEventListener("scroll", () => {
      this.follow = viewport.scrollTop + viewport.clientHeight >= viewport.scrollHeight - 8;
      this.schedule();
    });
    new ResizeObserver(() => this.schedule()).observe(viewport);
    // a row that grows or shrinks in place (an edit box, reasoning unfolded) moves the rows below it
    this.resized = new ResizeObserver(() => this.schedule());
  }

  reset(rows) {
    this.rows = rows;
    this.heights = rows.map(() => ESTIMATE_PX);
    for (const { node } of this.shown.values()) {
      this.resized.unobserve(node);
      node.remove();
    }
    this.shown.clear();
    this.follow = true;
    this.layout();
    this.render();
  }

  changed(indexes) {
    for (const i of indexes) {
      while (this.heights.length <= i) this.heights.push(ESTIMATE_PX);
    }
    this.layout();
    this.schedule();
  }

  layout() {
    const offsets = new Array(this.rows.length + 1);
    offsets[0] = 0;
    for (let i = 0; i < this.rows.length; i++) offsets[i + 1] = offsets[i] + this.heights[i];
    this.offsets = offsets;
    this.spacer.style.height = `${offsets[this.rows.length]}px`;
  }

  at(y) {
    let low = 0, high = this.rows.length - 1;
    while (low < high) {
      const mid = (low + high + 1) >> 1;
      if (this.offsets[mid] <= y) low = mid; else high = mid - 1;
    }
    return Math.max(0, low);
  }

  schedule() {
    if (this.queued) return;
    this.queued = true;
    requestAnimationFrame(() => {
      this.queued = false;
      this.render();
    });
  }

  render() {
    if (this.follow) this.viewport.scrollTop = this.offsets[this.rows.length];
    const top = this.viewport.scrollTop;
    const first = Math.max(0, this.at(top) - OVERSCAN);
    const last = Math.min(this.rows.length - 1, this.at(top + this.viewport.clientHeight) + OVERSCAN);
    for (const [i, shown] of this.shown) {
      if (i < first || i > last) {
        this.resized.unobserve(shown.node);
        shown.node.remove();
        this.shown.delete(i);
      }
    }
    let moved = false;
    for (let i = first; i <= last; i++) {
      const row = this.rows[i];
      let shown = this.shown.get(i);
      if (!shown || shown.version !== row.version) {
        const node = this.draw(row, i);
        if (shown) {
          this.resized.unobserve(shown.node);
          shown.node.replaceWith(node);
        } else {
          this.holder.append(node);
        }
        this.resized.observe(node);
        shown = { node, version: row.version };
        this.shown.set(i, shown);
      }
      shown.node.style.top = `${this.offsets[i]}px`;
    }
    for (let i = first; i <= last; i++) {
      const height = this.shown.get(i).node.offsetHeight;
      if (height !== this.heights[i]) {
        this.heights[i] = height;
        moved = true;
      }
    }
    if (moved) {
      this.layout();
      for (const [i, shown] of this.shown) shown.node.style.top = `${this.offsets[i]}px`;
      if (this.follow) this.viewport.scrollTop = this.offsets[this.rows.length];
    }
  }
}

const ui = {
  control: null,
  generator: null,
  sessions: [],
  tree: [],
  selected: null,
  summary: null,
  conversation: new Conversation(),
  list: null,
  sub: null,
  generating: null, // {started, first, row} while a generation this page asked for runs
  latencies: [], // commit to arrival, ms, of the live Generated events shown
  provisionalFrames: 0, // text ahead of its commit, frames shown
  painted: null, // ms from navigation to the selected session's first rows on screen
  pinned: 0,
  activity: new Map(), // session id -> {events, when}: its last event's time, for the list
  selecting: 0, // counts selects, so that only the latest one finishes
};

function status(text, state = "ok") {
  const node = $("status");
  node.textContent = text;
  node.dataset.state = state;
}

function fail(error) {
  status(`error: ${error.message}`, "error");
}

async function call(request) {
  return ui.control.call(request);
}

// ---- the sidebar: sessions and the fork tree ----

async function loadSessions() {
  const listed = expect(await call({ Sessions: { include_archived: $("show-archived").checked } }), "SessionList");
  ui.sessions = listed.sessions.sort((a, b) => b.id - a.id);
  ui.tree = expect(await call("Tree"), "Tree").nodes;
  drawSessions();
  drawTree();
  lastActivity(ui.sessions.slice(0, LAST_ACTIVITY_ROWS)).catch(fail);
}

function title(summary) {
  return summary.title || `session ${summary.id}`;
}

function drawSessions() {
  const list = $("sessions");
  list.replaceChildren();
  for (const s of ui.sessions) {
    const item = element("li");
    item.dataset.id = s.id;
    if (s.id === ui.selected) item.classList.add("selected");
    item.append(element("div", "name", title(s)));
    const sub = element("div", "sub", `#${s.id} · ${s.events} events · ${s.tokens} tokens${s.archived ? " · archived" : ""}`);
    sub.append(element("span", "when"));
    item.append(sub);
    item.onclick = () => select(s.id).catch(fail);
    list.append(item);
  }
}

async function lastActivity(summaries) {
  for (const s of summaries) {
    let known = ui.activity.get(s.id);
    if (s.events && known?.events !== s.events) {
      // read only the last event, and again only when the session has grown
      const events = expect(await call({ Read: { session: s.id, cursor: s.events - 1 } }), "Events").events;
      known = { events: s.events, when: events.length ? new Date(events[events.length - 1].ts_unix_ms) : null };
      ui.activity.set(s.id, known);
    }
    const node = document.querySelector(`#sessions li[data-id="${s.id}"] .when`);
    if (node && known?.when) node.textContent = ` · ${known.when.toLocaleString()}`;
  }
}

function drawTree() {
  const holder = $("tree");
  holder.replaceChildren();
  if (ui.selected === null) return;
  const nodes = new Map(ui.tree.map(([id, parent, forkAt]) => [id, { id, parent, forkAt, children: [] }]));
  for (const node of nodes.values()) nodes.get(node.parent)?.children.push(node);
  let root = nodes.get(ui.selected);
  if (!root) return; // archived sessions are not in the tree
  while (root.parent !== null && nodes.has(root.parent)) root = nodes.get(root.parent);
  const names = new Map(ui.sessions.map((s) => [s.id, title(s)]));
  const branch = (node) => {
    const item = element("li", "node");
    item.dataset.id = node.id;
    if (node.id === ui.selected) item.classList.add("selected");
    const at = node.parent === null ? "" : ` · at ${node.forkAt}`;
    const label = element("span", "label", `#${node.id} ${names.get(node.id) ?? ""}${at}`);
    label.onclick = () => select(node.id).catch(fail);
    item.append(label);
    if (node.children.length) {
      const list = element("ul");
      for (const child of node.children.sort((a, b) => a.id - b.id)) list.append(branch(child));
      item.append(list);
    }
    return item;
  };
  const top = element("ul");
  top.append(branch(root));
  holder.append(top);
}

// ---- the selected session ----

async function select(id) {
  const turn = ++ui.selecting; // a later click wins: an earlier select stops where it stands
  if (ui.sub !== null) {
    const sub = ui.sub;
    ui.sub = null;
    ui.control.subs.delete(sub);
    await call({ Unsubscribe: { sub } });
  }
  if (turn !== ui.selecting) return;
  ui.selected = id;
  ui.summary = ui.sessions.find((s) => s.id === id) ?? null;
  const conversation = new Conversation();
  ui.conversation = conversation;
  const events = expect(await call({ Read: { session: id, cursor: 0 } }), "Events").events;
  if (turn !== ui.selecting) return;
  for (const event of events) conversation.add(event);
  $("conversation").hidden = false;
  ui.painted = null;
  ui.list.reset(conversation.rows);
  requestAnimationFrame(() => (ui.painted = performance.now()));
  drawMeta();
  for (const node of document.querySelectorAll("#sessions li")) node.classList.toggle("selected", Number(node.dataset.id) === id);
  drawTree();
  const sub = expect(await call({ Subscribe: { session: id, cursor: conversation.next, provisional: true } }), "Subscribed").sub;
  if (turn !== ui.selecting) {
    await call({ Unsubscribe: { sub } }); // another session was chosen meanwhile
    return;
  }
  ui.sub = sub;
  ui.control.subs.set(sub, (variant, payload) => live(conversation, variant, payload));
  status(`session ${id}: ${events.length} events`);
  inspect(id).catch(fail);
}

function live(conversation, variant, payload) {
  if (conversation !== ui.conversation) return;
  let touched = [];
  if (variant === "SubEvent") {
    touched = conversation.add(payload.event);
    const [kind] = unpack(payload.event.body);
    if (kind === "Generated") {
      ui.latencies.push(Date.now() - payload.event.ts_unix_ms);
      if (ui.latencies.length > LATENCIES_KEPT) ui.latencies.shift();
    }
    firstToken(kind === "Generated");
  } else if (variant === "SubProvisional") {
    touched = [conversation.ahead(payload.channel, payload.text)];
    ui.provisionalFrames += 1;
    firstToken(true);
  } else {
    status(`subscription ended: ${payload.reason}`);
  }
  if (touched.length) ui.list.changed(touched);
}

function firstToken(isToken) {
  const running = ui.generating;
  if (running && isToken && running.first === null) {
    running.first = performance.now() - running.started;
    running.row = ui.conversation.openTurn();
  }
}

async function inspect(id) {
  const inspection = expect(await call({ Inspect: { session: id } }), "Inspection").inspection;
  if (id !== ui.selected) return;
  $("qos").value = String(inspection.qos_class);
  ui.pinned = inspection.pin_deadline_unix_ms > Date.now() ? inspection.pin_deadline_unix_ms : 0;
  const [tier, where] = unpack(inspection.tier);
  ui.tier = tier === "Parked" ? `parked (${where.covered} tokens)` : tier.toLowerCase();
  drawMeta();
}

function drawMeta() {
  const s = ui.summary;
  $("title").value = s?.title ?? "";
  $("archived").checked = Boolean(s?.archived);
  $("pin").textContent = ui.pinned ? "unpin" : "pin 1 h";
  const pin = ui.pinned ? ` · pinned until ${new Date(ui.pinned).toLocaleTimeString()}` : "";
  const tier = ui.tier ? ` · KV ${ui.tier}` : "";
  $("facts").textContent = s ? `#${s.id} · ${s.tokens} tokens${tier}${pin}` : "";
}

function drawRow(row, index) {
  if (row.type === "marker") {
    const node = element("div", `row marker ${row.cls}`, row.text);
    node.dataset.first = row.first;
    node.dataset.last = row.last;
    return node;
  }
  const role = row.type === "turn" ? 2 : row.type === "tool" ? 3 : row.role;
  const node = element("div", `row role-${role} ${row.type}`);
  node.dataset.index = index;
  node.dataset.first = row.first;
  node.dataset.last = row.last;
  const head = element("div", "head");
  const span = row.first === row.last ? `#${row.first}` : `#${row.first}–${row.last}`;
  let what = row.type === "tool" ? `tool call ${row.name}` : ROLES[role] ?? "raw";
  if (row.block !== undefined) what += ` block ${row.block}`;
  head.append(element("span", "", `${what} · ${span}`));
  if (row.type === "turn") head.append(element("span", "", turnFacts(row)));
  if (row.type === "message" && role >= 0 && row.block === undefined) head.append(button("edit", () => edit(row, node)));
  if (row.last !== null) head.append(button("fork here", () => fork(row).catch(fail)));
  node.append(head);
  const bubble = element("div", "bubble");
  if (row.type === "turn") {
    const live = row === ui.conversation.openTurn() ? ui.conversation.provisional : ["", "", ""];
    if (row.parts[REASONING] || live[REASONING]) {
      const folded = element("details", "reasoning");
      folded.append(element("summary", "", `reasoning (${(row.parts[REASONING] + live[REASONING]).length} characters)`));
      const text = element("div", "text", row.parts[REASONING]);
      text.append(element("span", "provisional", live[REASONING]));
      folded.append(text);
      bubble.append(folded);
    }
    bubble.append(document.createTextNode(row.parts[TEXT]));
    bubble.append(element("span", "provisional", live[TEXT]));
    if (row.parts[TOOL_CALL] || live[TOOL_CALL]) {
      const call = element("code", "", row.parts[TOOL_CALL]);
      call.append(element("span", "provisional", live[TOOL_CALL]));
      bubble.append(call);
    }
  } else if (row.type === "tool") {
    bubble.append(element("code", "", `${row.name}(${row.arguments})`));
    for (const result of row.results) bubble.append(element("div", "result", result));
  } else {
    bubble.textContent = row.text;
  }
  node.append(bubble);
  return node;
}

function turnFacts(row) {
  const facts = [row.open ? (row.cut ? "cut by a restart" : "generating") : FINISH[row.finish] ?? `finish ${row.finish}`];
  if (row.stats) {
    facts.push(`warm prefix ${row.stats.warm_prefix}`);
    if (row.stats.ttft !== null) facts.push(`first token ${Math.round(row.stats.ttft)} ms`);
  }
  return facts.join(" · ");
}

function button(label, onclick) {
  const node = element("button", "", label);
  node.type = "button";
  node.onclick = onclick;
  return node;
}

// ---- actions ----

async function createSession() {
  const created = expect(await call({ Create: { parent: null, params: GREEDY } }), "Created");
  await loadSessions();
  await select(created.session);
  $("message").focus();
}

async function send(event) {
  event.preventDefault();
  const text = $("message").value;
  if (!text.trim() || ui.selected === null) return;
  expect(await call({ AppendMessage: { session: ui.selected, role: 1, text } }), "Committed");
  $("message").value = "";
  await generate();
}

async function generate() {
  if (ui.generating || ui.selected === null) return;
  const session = ui.selected;
  const max_tokens = Number($("max-tokens").value) || 256;
  const ignore_eos = $("to-max").checked || null;
  ui.generating = { started: performance.now(), first: null, row: null };
  $("stop").disabled = false;
  $("generation").textContent = "generating…";
  try {
    const reply = await ui.generator.call({ Generate: { session, max_tokens, ignore_eos } });
    const done = expect(reply, "Generated");
    const running = ui.generating;
    const row = running.row ?? ui.conversation.rows.findLast((r) => r.type === "turn");
    if (row && session === ui.selected) {
      row.stats = { warm_prefix: done.warm_prefix, ttft: running.first };
      ui.list.changed([ui.conversation.touch(row)]);
    }
    const first = running.first === null ? "" : ` · first token ${Math.round(running.first)} ms`;
    $("generation").textContent =
      `${done.tokens_generated} tokens · ${FINISH[done.finish] ?? done.finish}${first} · warm prefix ${done.warm_prefix} tokens`;
  } catch (error) {
    $("generation").textContent = `generation failed: ${error.message}`;
  } finally {
    ui.generating = null;
    $("stop").disabled = true;
    refreshSummary().catch(fail);
  }
}

async function refreshSummary() {
  const listed = expect(await call({ Sessions: { include_archived: true } }), "SessionList").sessions;
  const fresh = listed.find((s) => s.id === ui.selected);
  if (fresh) {
    ui.summary = fresh;
    ui.sessions = ui.sessions.map((s) => (s.id === fresh.id ? fresh : s));
    drawMeta();
    drawSessions();
  }
}

async function stop() {
  if (ui.selected !== null) await call({ Cancel: { session: ui.selected } });
}

async function fork(row) {
  const created = expect(await call({ Fork: { session: ui.selected, at_event: row.last + 1, params: null } }), "Created");
  await loadSessions();
  await select(created.session);
}

function edit(row, node) {
  const bubble = node.querySelector(".bubble");
  const box = element("div", "edit");
  const text = element("textarea");
  text.value = row.text;
  box.append(text, button("save as a new branch", () => rebase(row, text.value).catch(fail)), button("cancel", () => ui.list.changed([ui.conversation.touch(row)])));
  bubble.replaceWith(box);
  text.focus();
}

async function rebase(row, text) {
  const edits = [{ Replace: { from: row.first, to: ui.conversation.next, role: row.role, text } }];
  const created = expect(await call({ Rebase: { session: ui.selected, edits, params: null } }), "Created");
  await loadSessions();
  await select(created.session);
}

async function setMeta(title, archived) {
  const s = ui.summary;
  const meta = expect(await call({ SetMeta: { session: s.id, expected_version: s.meta_version, title, archived } }), "Meta");
  s.meta_version = meta.version;
  await loadSessions();
}

async function setQos() {
  expect(await call({ SetQos: { session: ui.selected, class: Number($("qos").value), batch_invariant: false } }), "Committed");
}

async function togglePin() {
  const pinned = expect(await call({ Pin: { session: ui.selected, ttl_ms: ui.pinned ? 0 : PIN_MS } }), "Pinned");
  ui.pinned = pinned.deadline_unix_ms > Date.now() ? pinned.deadline_unix_ms : 0;
  drawMeta();
}

// ---- start ----

async function start() {
  const { token, session } = signIn();
  if (!token) {
    $("signin").hidden = false;
    status("not signed in", "error");
    return;
  }
  ui.control = new Channel(token, "request");
  ui.generator = new Channel(token, "generation");
  try {
    await ui.control.open();
    await ui.generator.open();
  } catch (error) {
    sessionStorage.removeItem("superfluid.token"); // a token of an earlier start: ask for the new address
    $("signin").hidden = false;
    fail(error);
    return;
  }
  ui.control.onclose = () => status("disconnected: the daemon stopped or restarted; reload with its new address", "error");
  ui.list = new VirtualList($("events"), $("spacer"), $("rows"), drawRow);
  $("new-session").onclick = () => createSession().catch(fail);
  $("show-archived").onchange = () => loadSessions().catch(fail);
  $("composer").onsubmit = (event) => send(event).catch(fail);
  $("message").onkeydown = (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  };
  $("generate").onclick = () => generate().catch(fail);
  $("stop").onclick = () => stop().catch(fail);
  $("title").onchange = () => setMeta($("title").value, null).catch(fail);
  $("archived").onchange = () => setMeta(null, $("archived").checked).catch(fail);
  $("qos").onchange = () => setQos().catch(fail);
  $("pin").onclick = () => togglePin().catch(fail);
  status("connected");
  await loadSessions();
  if (session !== null) await select(session);
}

window.superfluid = ui; // for whoever drives the page (the tests read its latencies)
start().catch(fail);
