// andrea.serve's page. Generate streams POST /v1/completions (server-sent events, with the token ids:
// return_token_ids); when the stream ends, every token of prompt and completion becomes a box, and a
// click on one asks POST /andrea/trace for that position and draws what andrea.trace prints: per block
// the residual stream's size, each head's attention row as a heat map, and the logit lens.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { ids: [], promptLength: 0, controller: null, pieces: [] };

async function post(path, body, signal) {
  const response = await fetch(path, {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body), signal,
  });
  if (!response.ok) {
    const data = await response.json().catch(() => ({}));
    throw new Error(data.error ? data.error.message : `${response.status} ${response.statusText}`);
  }
  return response;
}

function say(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

function settings() {
  const number = (id) => Number($(id).value);
  return {
    prompt: $("prompt").value, max_tokens: number("max_tokens"), temperature: number("temperature"),
    top_k: number("top_k"), top_p: number("top_p"), seed: number("seed"), stream: true, return_token_ids: true,
  };
}

// The body of a streamed completion: events "data: {json}" separated by blank lines, the last "data: [DONE]".
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ")) continue;
      if (line === "data: [DONE]") return;
      const event = JSON.parse(line.slice(6));
      if (event.error) throw new Error(event.error.message);
      yield event;
    }
  }
}

function busy(on) {
  $("generate").disabled = on;
  $("stop").disabled = !on;
}

async function generate() {
  const body = settings();
  const box = $("tokens");
  box.replaceChildren();
  $("trace").hidden = true;
  state.ids = [];
  state.controller = new AbortController();
  busy(true);
  say("generating…");
  const started = performance.now();
  let first = null;
  let reason = "stopped";
  try {
    const response = await post("/v1/completions", body, state.controller.signal);
    for await (const chunk of events(response)) {
      const choice = chunk.choices[0];
      if (choice.prompt_token_ids) {
        state.ids = choice.prompt_token_ids.slice();
        state.promptLength = state.ids.length;
        box.append(document.createTextNode(body.prompt));
      }
      state.ids.push(...(choice.token_ids || []));
      if (choice.text) {
        first = first ?? performance.now();
        const live = document.createElement("span");
        live.className = "live";
        live.textContent = choice.text;
        box.append(live);
      }
      if (choice.finish_reason) reason = choice.finish_reason;
    }
  } catch (error) {
    if (error.name !== "AbortError") {
      say(error.message, true);
      busy(false);
      return;
    }
  }
  busy(false);
  const made = state.ids.length - state.promptLength;
  const seconds = (performance.now() - started) / 1000;
  say(`${made} tokens in ${seconds.toFixed(2)} s (finish: ${reason}` +
      (first ? `, first text after ${((first - started) / 1000).toFixed(2)} s)` : ")"));
  if (state.ids.length) await showTokens();
}

async function showTokens() {
  const data = await (await post("/andrea/tokens", { ids: state.ids })).json();
  state.pieces = data.pieces;
  const box = $("tokens");
  box.replaceChildren(...data.pieces.map((piece, position) => {
    const span = document.createElement("span");
    span.className = position >= state.promptLength ? "tok gen" : "tok";
    span.textContent = piece;
    span.dataset.pos = position;
    span.title = `position ${position}: ${JSON.stringify(piece)}`;
    return span;
  }));
  await trace(state.ids.length - 1);
}

async function trace(position) {
  for (const span of document.querySelectorAll(".tok.selected")) span.classList.remove("selected");
  const span = document.querySelector(`.tok[data-pos="${position}"]`);
  if (span) span.classList.add("selected");
  say(`tracing position ${position}…`);
  let data;
  try {
    data = await (await post("/andrea/trace", { ids: state.ids, position, top: 5 })).json();
  } catch (error) {
    say(error.message, true);
    return;
  }
  drawTrace(data);
  say(`position ${position} traced`);
}

function ranked(list, entries) {
  list.className = "ranked";
  list.replaceChildren(...entries.map(([piece, , p]) => {
    const item = document.createElement("li");
    const prob = document.createElement("span");
    prob.className = "p";
    prob.textContent = ` ${p.toFixed(3)}`;
    item.append(JSON.stringify(piece), prob);
    return item;
  }));
  return list;
}

function residual(block, largest) {
  const box = document.createElement("div");
  box.className = "residual";
  ["in", "after attention", "after MLP"].forEach((label, i) => {
    const text = document.createElement("div");
    text.textContent = `${label} ${block.residual[i].toFixed(3)}`;
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.width = `${(100 * block.residual[i] / largest).toFixed(1)}%`;
    box.append(text, bar);
  });
  return box;
}

function drawTrace(data) {
  const largest = Math.max(...data.blocks.flatMap((b) => b.residual), 1e-12);
  const at = data.position - data.start;
  $("trace-title").textContent = `Position ${data.position}: ${JSON.stringify(data.tokens[at])}`;
  $("blocks").replaceChildren(...data.blocks.map((block, i) => {
    const row = document.createElement("div");
    row.className = "block";
    const title = document.createElement("h3");
    title.textContent = `block ${i}`;
    const left = document.createElement("div");
    left.append(title, residual(block, largest));
    const lens = document.createElement("div");
    const lensTitle = document.createElement("h3");
    lensTitle.textContent = "logit lens";
    lens.append(lensTitle, ranked(document.createElement("ol"), block.lens));
    row.append(left, heatmap(block.attention, data.tokens, data.start), lens);
    return row;
  }));
  ranked($("output"), data.output);
  $("trace").hidden = false;
}

// viridis at five stops, interpolated: 0 dark blue, 1 yellow
const STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function colour(p) {
  const x = Math.min(Math.max(p, 0), 1) * (STOPS.length - 1);
  const i = Math.min(Math.floor(x), STOPS.length - 2);
  const f = x - i;
  const [a, b] = [STOPS[i], STOPS[i + 1]];
  return `rgb(${a.map((v, k) => Math.round(v + f * (b[k] - v))).join(",")})`;
}

// Each head's attention row as a line of cells, coloured from 0 (dark) to the largest probability in
// the map (yellow), so that a nearly uniform head still shows its preferences; the scale is printed.
function heatmap(rows, tokens, start) {
  const canvas = document.createElement("canvas");
  canvas.className = "heatmap";
  const label = 46;
  const cell = Math.max(2, Math.min(22, Math.floor(640 / rows[0].length)));
  const height = 14;
  const largest = Math.max(...rows.flat(), 1e-12);
  canvas.width = label + cell * rows[0].length;
  canvas.height = height * rows.length;
  const g = canvas.getContext("2d");
  g.font = "10px sans-serif";
  g.textBaseline = "middle";
  rows.forEach((row, h) => {
    g.fillStyle = "#333";
    g.fillText(`head ${h}`, 2, h * height + height / 2);
    row.forEach((p, j) => {
      g.fillStyle = colour(p / largest);
      g.fillRect(label + j * cell, h * height, cell, height);
    });
  });
  canvas.addEventListener("mousemove", (event) => {
    const box = canvas.getBoundingClientRect();
    const x = (event.clientX - box.left) * canvas.width / box.width - label;
    const h = Math.floor((event.clientY - box.top) * canvas.height / box.height / height);
    const j = Math.floor(x / cell);
    const ok = x >= 0 && rows[h] && j < rows[h].length;
    canvas.title = ok ? `head ${h} -> position ${start + j} ${JSON.stringify(tokens[j])}: ${rows[h][j].toFixed(3)}` : "";
  });
  Object.assign(canvas.dataset, { heads: rows.length, label, cell, height });
  const figure = document.createElement("figure");
  const caption = document.createElement("figcaption");
  caption.textContent = `attention to positions ${start}..${start + rows[0].length - 1}; ` +
    `yellow: ${largest.toFixed(3)}, the largest here`;
  figure.append(canvas, caption);
  return figure;
}

async function showModel() {
  try {
    const response = await fetch("/v1/models");
    const model = (await response.json()).data[0];
    $("model").textContent = `${model.id}, context ${model.context_length} tokens`;
  } catch (error) {
    $("model").textContent = `the model's name did not load: ${error.message}`;
  }
}

$("generate").addEventListener("click", generate);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("tokens").addEventListener("click", (event) => {
  const span = event.target.closest(".tok");
  if (span) trace(Number(span.dataset.pos));
});
showModel();
