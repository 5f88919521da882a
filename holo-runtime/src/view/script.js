// holo view: the page's behaviour. The data (see page.rs) is parsed once; the list draws only the items
// in view, a rollout's detail is drawn when it is selected, and the state lives in the URL's fragment.
'use strict';

const D = JSON.parse(document.getElementById('holo-data').textContent);
const R = D.rollouts;
const $ = (id) => document.getElementById(id);

// Pixels per list item; the list's spacer is this times the items shown, and only those in view exist.
const ITEM_HEIGHT = 46;
// Items drawn above and below the visible ones, so a fast scroll shows no gap.
const OVERSCAN = 12;
// Rows of the completions table drawn at a time.
const STEP_PAGE = 100;
// Points above which a chart draws a line only (one circle per point would be slow and unreadable).
const MAX_MARKERS = 60;

// Every key the fragment may hold; '' is "not set".
const DEFAULTS = {
  tab: 'rollouts', file: '', step: '', row: '', min: '', max: '', status: '', q: '', sort: '',
  sel: '', group: '', show: '', at: '', atfile: '', metric: '',
};
const FILTER_KEYS = ['file', 'step', 'row', 'min', 'max', 'status', 'q', 'sort'];

let state = readHash();
let shown = [];
let stepLimit = STEP_PAGE;

const esc = (text) => String(text).replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' }[c]));
const num = (x, digits = 3) => (typeof x !== 'number' || !Number.isFinite(x) ? '–' : Number.isInteger(x) ? String(x) : x.toFixed(digits));

function readHash() {
  const params = new URLSearchParams(location.hash.slice(1));
  const read = { ...DEFAULTS };
  for (const key of Object.keys(DEFAULTS)) if (params.has(key)) read[key] = params.get(key);
  return read;
}

function writeHash() {
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(state)) if (value !== DEFAULTS[key]) params.set(key, value);
  const fragment = params.toString();
  history.replaceState(null, '', fragment ? '#' + fragment : location.pathname + location.search);
}

function update(changes) {
  Object.assign(state, changes);
  writeHash();
}

// ---- what each rollout is ----

function status(r) {
  return r.error ? 'failed' : r.truncated ? 'truncated' : 'completed';
}

// The model's text: every sampled part, in order, turns separated by ⏎.
function sampledText(r) {
  if (r._sampled === undefined) {
    const turns = [];
    for (const context of r.contexts) for (const message of context.messages) {
      const text = message.parts.filter((p) => p.sampled).map((p) => p.text).join('');
      if (text) turns.push(text);
    }
    r._sampled = turns.join(' ⏎ ');
  }
  return r._sampled;
}

// What the search looks in, lower-cased once per rollout, on the first search.
function haystack(r) {
  if (r._haystack === undefined) {
    const texts = [JSON.stringify(r.row), r.error ? r.error.message : ''];
    for (const context of r.contexts) for (const message of context.messages) for (const part of message.parts) texts.push(part.text);
    r._haystack = texts.join('\n').toLowerCase();
  }
  return r._haystack;
}

function stepOf(r) {
  return r.step === undefined || r.step === null ? '' : String(r.step);
}

function groupOf(i) {
  const r = R[i];
  const members = [];
  R.forEach((other, j) => {
    if (other.file === r.file && other.row_index === r.row_index && stepOf(other) === stepOf(r)) members.push(j);
  });
  return members.sort((a, b) => R[a].rollout_index - R[b].rollout_index);
}

// ---- the list ----

function matches(r, q) {
  if (state.file !== '' && r.file !== Number(state.file)) return false;
  if (state.step !== '' && stepOf(r) !== state.step) return false;
  if (state.row !== '' && r.row_index !== Number(state.row)) return false;
  if (state.min !== '' && !(r.reward >= Number(state.min))) return false;
  if (state.max !== '' && !(r.reward <= Number(state.max))) return false;
  if (state.status !== '' && status(r) !== state.status) return false;
  return q === '' || haystack(r).includes(q);
}

function applyFilters() {
  const q = state.q.trim().toLowerCase();
  shown = [];
  for (let i = 0; i < R.length; i++) if (matches(R[i], q)) shown.push(i);
  if (state.sort === 'reward-desc') shown.sort((a, b) => R[b].reward - R[a].reward || a - b);
  if (state.sort === 'reward-asc') shown.sort((a, b) => R[a].reward - R[b].reward || a - b);
  $('count').textContent = `${shown.length} of ${R.length} rollouts`;
  $('list-spacer').style.height = shown.length * ITEM_HEIGHT + 'px';
  renderList();
}

function renderList() {
  const list = $('list');
  const height = list.clientHeight || window.innerHeight;
  const first = Math.max(0, Math.floor(list.scrollTop / ITEM_HEIGHT) - OVERSCAN);
  const last = Math.min(shown.length, Math.ceil((list.scrollTop + height) / ITEM_HEIGHT) + OVERSCAN);
  let html = '';
  for (let k = first; k < last; k++) html += itemHtml(shown[k], k);
  $('list-items').innerHTML = html;
}

function itemHtml(i, position) {
  const r = R[i];
  const st = status(r);
  const step = stepOf(r) === '' ? '' : `<span>step ${r.step}</span>`;
  const file = D.files.length > 1 ? `<span>${esc(D.files[r.file])}</span>` : '';
  const preview = r.error ? r.error.message : sampledText(r);
  return `<div class="item${String(i) === state.sel ? ' selected' : ''}" data-i="${i}" data-status="${st}" style="top:${position * ITEM_HEIGHT}px">`
    + `<div class="meta"><span>row ${r.row_index} · #${r.rollout_index}</span>${step}${file}<span class="badge ${st}">${st}</span>`
    + `<span class="reward">${num(r.reward)}</span></div><div class="preview">${esc(preview.slice(0, 300))}</div></div>`;
}

function select(i) {
  update({ sel: String(i), group: '' });
  renderList();
  renderDetail();
}

// Moves the selection by `delta` items of the filtered list, scrolling it into view.
function moveSelection(delta) {
  if (shown.length === 0) return;
  const at = shown.indexOf(Number(state.sel));
  const next = Math.min(shown.length - 1, Math.max(0, at < 0 ? 0 : at + delta));
  const list = $('list');
  const top = next * ITEM_HEIGHT;
  if (top < list.scrollTop) list.scrollTop = top;
  if (top + ITEM_HEIGHT > list.scrollTop + list.clientHeight) list.scrollTop = top + ITEM_HEIGHT - list.clientHeight;
  select(shown[next]);
}

// ---- one rollout ----

function renderDetail() {
  const detail = $('detail');
  const i = Number(state.sel);
  if (state.sel === '' || !R[i]) {
    detail.innerHTML = '<p class="hint">Select a rollout (click, or j / k).</p>';
    return;
  }
  const r = R[i];
  const st = status(r);
  const members = groupOf(i);
  const showTokens = state.show !== 'messages';
  let html = `<h2>row ${r.row_index} · rollout ${r.rollout_index}${stepOf(r) === '' ? '' : ' · step ' + r.step} `
    + `<span class="badge ${st}">${st}</span></h2>`
    + `<p class="sub">${esc(D.files[r.file])}, line ${r.line} · reward ${num(r.reward)} · ${r.samples} sample${r.samples === 1 ? '' : 's'} · seed ${r.seed_text}`
    + (r.timing ? ` · ${num(r.timing.wall_ms / 1000, 2)} s (sampling ${num(r.timing.sample_ms / 1000, 2)} s)` : '')
    + (r.dataset ? ` · dataset ${esc(r.dataset)}` : '') + '</p>'
    + '<div class="actions">'
    + `<button type="button" data-action="detail" class="${state.group ? '' : 'active'}">this rollout</button>`
    + `<button type="button" data-action="group" class="${state.group ? 'active' : ''}">its group side by side (${members.length})</button>`
    + (state.group ? '' : `<button type="button" data-action="tokens" class="${showTokens ? 'active' : ''}">tokens</button>`
      + `<button type="button" data-action="messages" class="${showTokens ? '' : 'active'}">messages</button>`)
    + '</div>';
  if (r.error) html += `<p class="error">${esc(r.error.stage)}: ${esc(r.error.message)}</p>`;
  html += state.group ? groupHtml(members) : rolloutHtml(r, showTokens);
  detail.innerHTML = html;
}

function rolloutHtml(r, showTokens) {
  let html = '<h3>Reward components</h3>' + rewardsHtml(r) + '<h3>Inputs (the data row)</h3>' + inputsHtml(r.row);
  r.contexts.forEach((context, c) => {
    const tokens = context.tokens;
    const trained = tokens ? tokens.loss_mask.reduce((sum, bit) => sum + bit, 0) : 0;
    const head = `context ${c + 1} · ${context.trained ? 'trained' : 'not trained'}`
      + (tokens ? ` · ${tokens.ids.length} tokens, ${trained} trained` + (tokens.retokenized ? ' · retokenized (ids may differ from what was sampled)' : '') : '');
    const body = showTokens && tokens ? tokensHtml(r, c, tokens) : messagesHtml(context.messages);
    html += `<div class="context"><div class="head">${head}</div>${body}</div>`;
  });
  return html;
}

function rewardsHtml(r) {
  const names = Object.keys(r.rewards);
  if (names.length === 0) return '<p class="hint">none recorded</p>';
  // Why each component got its value, where its holotype said (the records' `feedback`).
  const feedback = r.feedback || {};
  let html = '<table><tr><th>component</th><th>value</th><th>weight</th><th>weighted</th><th>feedback</th></tr>';
  for (const name of names) {
    const value = r.rewards[name];
    const weight = r.weights[name];
    const weighted = typeof weight === 'number' ? value * weight : undefined;
    html += `<tr><td>${esc(name)}</td><td class="num">${num(value)}</td><td class="num">${num(weight)}</td><td class="num">${num(weighted)}</td><td>${esc(feedback[name] || '')}</td></tr>`;
  }
  return html + `<tr><th>total</th><td></td><td></td><td class="num"><b>${num(r.reward)}</b></td><td></td></tr></table>`;
}

function inputsHtml(row) {
  const keys = Object.keys(row || {});
  if (keys.length === 0) return '<p class="hint">none</p>';
  let html = '<table>';
  for (const key of keys) {
    const value = row[key];
    html += `<tr><th>${esc(key)}</th><td class="value">${esc(typeof value === 'string' ? value : JSON.stringify(value))}</td></tr>`;
  }
  return html + '</table>';
}

function messagesHtml(messages) {
  let html = '';
  for (const message of messages) {
    const body = message.parts.map((p) => (p.sampled ? `<mark class="sampled">${esc(p.text)}</mark>` : esc(p.text))).join('');
    html += `<div class="msg role-${esc(message.role)}"><div class="role">${esc(message.role)}</div><div class="body">${body}</div></div>`;
  }
  return html;
}

// Chat-template frame tokens (`<|im_start|>`, `<|eot_id|>`, …), dimmed so the text stands out.
const FRAME = /^<\|[^|\s]+\|>$|^<\/?s>$/;

// A context token by token: trained ones on alternating greens, so each token's extent shows.
function tokensHtml(r, c, tokens) {
  const texts = r.texts && r.texts[c];
  let html = '';
  let trained = 0;
  for (let k = 0; k < tokens.ids.length; k++) {
    const text = texts ? D.pieces[texts[k]] : String(tokens.ids[k]);
    let cls = texts ? 'tok' : 'tok id';
    if (tokens.loss_mask[k]) cls += ' trained t' + (trained++ % 2);
    if (texts && FRAME.test(text)) cls += ' frame';
    html += `<span class="${cls}" data-c="${c}" data-k="${k}">${esc(text)}</span>`;
  }
  return `<pre class="tokens">${html}</pre>`;
}

function tokenTip(r, c, k) {
  const tokens = r.contexts[c].tokens;
  const texts = r.texts && r.texts[c];
  const trained = tokens.loss_mask[k] === 1;
  const lines = [`token ${k} · id ${tokens.ids[k]}` + (texts ? ` · ${JSON.stringify(D.pieces[texts[k]])}` : '')];
  lines.push(trained ? 'trained (sampled by the model)' : 'not trained');
  const logprob = tokens.logprobs[k];
  // The records write 0 where the sampler gave no log-prob.
  if (trained && logprob !== 0) lines.push(`sampling log-prob ${num(logprob, 4)} (p ${num(Math.exp(logprob), 4)})`);
  if (trained && logprob === 0) lines.push('sampling log-prob: none recorded');
  const policy = trained && r.policy && r.policy[c];
  if (policy) {
    // The policy's values run over the context's trained tokens in order.
    let index = 0;
    for (let j = 0; j < k; j++) if (tokens.loss_mask[j]) index++;
    const value = policy[index];
    lines.push(`policy log-prob ${num(value, 4)} (p ${num(Math.exp(value), 4)}; ${D.policy.name}, temperature ${D.policy.temperature})`);
    if (logprob !== 0) lines.push(`ratio policy / sampling ${num(Math.exp(value - logprob), 4)}`);
  }
  return lines.join('\n');
}

// The rollouts of one row at one step side by side: the prompt once, then each one's sampled text.
function groupHtml(members) {
  const first = R[members[0]];
  const context = first.contexts.find((ctx) => ctx.messages.some((m) => m.parts.some((p) => p.sampled))) || first.contexts[0];
  const prompt = context ? context.messages.slice(0, Math.max(0, context.messages.findIndex((m) => m.parts.some((p) => p.sampled)))) : [];
  let html = `<h3>Prompt</h3><div class="prompt">${messagesHtml(prompt)}</div><h3>Rollouts</h3><div class="group">`;
  for (const j of members) {
    const r = R[j];
    const st = status(r);
    const body = r.error ? `${esc(r.error.message)}\n\n${esc(sampledText(r))}` : esc(sampledText(r));
    html += `<div class="member${String(j) === state.sel ? ' current' : ''}"><div class="head" data-i="${j}">#${r.rollout_index} <span class="badge ${st}">${st}</span>`
      + `<span class="reward">${num(r.reward)}</span></div><div class="body">${body}</div></div>`;
  }
  return html + '</div>';
}

// ---- completions per step ----

function stepFiles() {
  return D.files.map((_, f) => f).filter((f) => R.some((r) => r.file === f && stepOf(r) !== ''));
}

function renderSteps() {
  const files = stepFiles();
  const file = files.includes(Number(state.atfile)) ? Number(state.atfile) : files[0];
  const rows = R.map((_, i) => i).filter((i) => R[i].file === file && stepOf(R[i]) !== '');
  const steps = [...new Set(rows.map((i) => R[i].step))].sort((a, b) => a - b);
  const at = steps.includes(Number(state.at)) ? Number(state.at) : steps[0];
  const here = rows.filter((i) => R[i].step === at);
  const fileSelect = files.length > 1
    ? `<label>file <select id="steps-file">${files.map((f) => `<option value="${f}"${f === file ? ' selected' : ''}>${esc(D.files[f])}</option>`).join('')}</select></label>`
    : `<span>${esc(D.files[file])}</span>`;
  $('steps-bar').innerHTML = fileSelect
    + `<button type="button" data-move="-1">◀</button><label>step <select id="steps-step">`
    + steps.map((s) => `<option value="${s}"${s === at ? ' selected' : ''}>${s}</option>`).join('')
    + `</select></label><button type="button" data-move="1">▶</button>`;
  const rewards = here.filter((i) => !R[i].error).map((i) => R[i].reward);
  const mean = rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : undefined;
  const count = (st) => here.filter((i) => status(R[i]) === st).length;
  $('steps-summary').innerHTML = `<p class="sub">step ${at}: ${here.length} rollouts · mean reward ${num(mean)} · `
    + `${count('truncated')} truncated · ${count('failed')} failed</p>`;
  let html = '<table><tr><th>row</th><th>#</th><th>reward</th><th>status</th><th>prompt</th><th>completion</th></tr>';
  for (const i of here.slice(0, stepLimit)) {
    const r = R[i];
    const st = status(r);
    html += `<tr data-i="${i}"><td class="num">${r.row_index}</td><td class="num">${r.rollout_index}</td><td class="num">${num(r.reward)}</td>`
      + `<td><span class="badge ${st}">${st}</span></td><td class="text">${esc(promptText(r).slice(-400))}</td>`
      + `<td class="text">${esc(r.error ? r.error.message : sampledText(r))}</td></tr>`;
  }
  html += '</table>';
  if (here.length > stepLimit) html += `<p><button type="button" id="steps-more">${here.length - stepLimit} more</button></p>`;
  $('steps-table').innerHTML = html;
  return steps;
}

// The last message the model was given before it first wrote.
function promptText(r) {
  for (const context of r.contexts) {
    const at = context.messages.findIndex((m) => m.parts.some((p) => p.sampled));
    if (at > 0) return context.messages[at - 1].parts.map((p) => p.text).join('');
  }
  return '';
}

// ---- metrics ----

function metricKeys() {
  const keys = new Set();
  for (const row of D.metrics) for (const [key, value] of Object.entries(row)) if (key !== 'step' && typeof value === 'number') keys.add(key);
  return [...keys].sort((a, b) => (a.startsWith('eval/') - b.startsWith('eval/')) || a.localeCompare(b));
}

function renderMetrics() {
  const filter = state.metric.toLowerCase();
  $('metric-filter').value = state.metric;
  $('charts').innerHTML = metricKeys().filter((key) => key.toLowerCase().includes(filter)).map(chartHtml).join('')
    || '<p class="hint">no metric matches</p>';
}

function chartHtml(key) {
  const points = D.metrics.filter((row) => typeof row[key] === 'number' && typeof row.step === 'number').map((row) => [row.step, row[key]]);
  const [width, height, left, right, top, bottom] = [300, 140, 44, 8, 8, 18];
  const xs = points.map((p) => p[0]);
  const ys = points.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
  if (y0 === y1) [y0, y1] = [y0 - 1, y1 + 1];
  const x = (v) => left + ((v - x0) / (x1 - x0)) * (width - left - right);
  const y = (v) => top + (1 - (v - y0) / (y1 - y0)) * (height - top - bottom);
  const line = points.map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`).join(' ');
  const markers = points.length <= MAX_MARKERS
    ? points.map((p) => `<circle cx="${x(p[0]).toFixed(1)}" cy="${y(p[1]).toFixed(1)}" r="2"><title>step ${p[0]}: ${p[1]}</title></circle>`).join('')
    : '';
  const last = points[points.length - 1];
  return `<div class="chart" data-metric="${esc(key)}"><div class="name">${esc(key)} <span class="sub">last ${num(last[1], 4)} (step ${last[0]})</span></div>`
    + `<svg width="${width}" height="${height}" viewBox="0 0 ${width} ${height}" role="img" aria-label="${esc(key)}">`
    + `<line x1="${left}" y1="${top}" x2="${left}" y2="${height - bottom}"/><line x1="${left}" y1="${height - bottom}" x2="${width - right}" y2="${height - bottom}"/>`
    + `<text x="${left - 4}" y="${top + 8}" text-anchor="end">${num(y1, 3)}</text><text x="${left - 4}" y="${height - bottom}" text-anchor="end">${num(y0, 3)}</text>`
    + `<text x="${left}" y="${height - 4}">${num(x0)}</text><text x="${width - right}" y="${height - 4}" text-anchor="end">${num(x1)}</text>`
    + `<polyline points="${line}"/>${markers}</svg></div>`;
}

// ---- tabs, notices, wiring ----

function tabs() {
  const available = { rollouts: true, steps: stepFiles().length > 0, metrics: Array.isArray(D.metrics) && D.metrics.length > 0 };
  return Object.keys(available).filter((tab) => available[tab]);
}

function renderTab() {
  const open = tabs().includes(state.tab) ? state.tab : 'rollouts';
  for (const button of document.querySelectorAll('#tabs button')) {
    button.hidden = !tabs().includes(button.dataset.tab);
    button.classList.toggle('active', button.dataset.tab === open);
  }
  for (const section of document.querySelectorAll('.tab')) section.hidden = section.id !== 'tab-' + open;
  if (open === 'steps') renderSteps();
  if (open === 'metrics') renderMetrics();
  if (open === 'rollouts') renderList();
}

function renderNotices() {
  let html = '';
  if (D.skipped.length > 0) {
    const items = D.skipped.map((s) => `<li>${esc(s.file)}, line ${s.line}: ${esc(s.message)}</li>`).join('');
    html += `<details class="notice" id="skipped"><summary>${D.skipped.length} line${D.skipped.length === 1 ? '' : 's'} skipped (not records)</summary><ol>${items}</ol></details>`;
  }
  if (D.ids_only) html += `<p class="notice" id="ids-only">Tokens are shown as ids: ${esc(D.ids_only)}</p>`;
  $('notices').innerHTML = html;
}

function fillSelect(select, values, label) {
  select.innerHTML = '<option value="">any</option>' + values.map((v) => `<option value="${esc(v)}">${esc(label(v))}</option>`).join('');
}

function setupFilters() {
  const form = $('filters');
  fillSelect(form.elements.file, D.files.map((_, f) => String(f)), (f) => D.files[Number(f)]);
  $('file-filter').hidden = D.files.length < 2;
  const steps = [...new Set(R.map(stepOf).filter((s) => s !== ''))].sort((a, b) => a - b);
  fillSelect(form.elements.step, steps, (s) => s);
  $('step-filter').hidden = steps.length === 0;
  for (const key of FILTER_KEYS) form.elements[key].value = state[key];
  form.addEventListener('input', () => {
    const changes = {};
    for (const key of FILTER_KEYS) changes[key] = form.elements[key].value;
    update(changes);
    $('list').scrollTop = 0;
    applyFilters();
  });
  form.addEventListener('submit', (event) => event.preventDefault());
}

function setupEvents() {
  $('tabs').addEventListener('click', (event) => {
    const tab = event.target.dataset && event.target.dataset.tab;
    if (tab) { update({ tab }); renderTab(); }
  });
  $('list').addEventListener('scroll', () => requestAnimationFrame(renderList));
  window.addEventListener('resize', () => requestAnimationFrame(renderList));
  $('list-items').addEventListener('click', (event) => {
    const item = event.target.closest('.item');
    if (item) select(Number(item.dataset.i));
  });
  $('detail').addEventListener('click', (event) => {
    const head = event.target.closest('.member > .head');
    if (head) { select(Number(head.dataset.i)); return; }
    const action = event.target.dataset && event.target.dataset.action;
    if (action === 'group') update({ group: '1' });
    if (action === 'detail') update({ group: '' });
    if (action === 'tokens' || action === 'messages') update({ show: action === 'messages' ? 'messages' : '' });
    if (action) renderDetail();
  });
  $('detail').addEventListener('mouseover', (event) => showTip(event));
  $('detail').addEventListener('mouseout', () => { $('tooltip').hidden = true; });
  $('tab-steps').addEventListener('change', (event) => {
    if (event.target.id === 'steps-file') update({ atfile: event.target.value, at: '' });
    if (event.target.id === 'steps-step') update({ at: event.target.value });
    stepLimit = STEP_PAGE;
    renderSteps();
  });
  $('tab-steps').addEventListener('click', (event) => {
    if (event.target.dataset && event.target.dataset.move) {
      const steps = renderSteps();
      const at = steps.indexOf(Number($('steps-step').value)) + Number(event.target.dataset.move);
      if (at >= 0 && at < steps.length) { update({ at: String(steps[at]) }); stepLimit = STEP_PAGE; renderSteps(); }
      return;
    }
    if (event.target.id === 'steps-more') { stepLimit += STEP_PAGE; renderSteps(); return; }
    const row = event.target.closest('tr[data-i]');
    if (row) openInList(Number(row.dataset.i));
  });
  $('metric-filter').addEventListener('input', (event) => { update({ metric: event.target.value }); renderMetrics(); });
  document.addEventListener('keydown', (event) => {
    if (state.tab !== 'rollouts' || event.target.matches('input, select, textarea')) return;
    if (event.key === 'j' || event.key === 'ArrowDown') { moveSelection(1); event.preventDefault(); }
    if (event.key === 'k' || event.key === 'ArrowUp') { moveSelection(-1); event.preventDefault(); }
  });
  window.addEventListener('hashchange', () => { state = readHash(); start(); });
}

// Shows rollout `i` in the rollouts tab, its step and file as the list's filters.
function openInList(i) {
  const r = R[i];
  const form = $('filters');
  for (const key of FILTER_KEYS) form.elements[key].value = '';
  form.elements.file.value = String(r.file);
  form.elements.step.value = stepOf(r);
  update({ ...Object.fromEntries(FILTER_KEYS.map((key) => [key, form.elements[key].value])), tab: 'rollouts', sel: String(i), group: '' });
  applyFilters();
  renderTab();
  renderDetail();
  const at = shown.indexOf(i);
  if (at >= 0) $('list').scrollTop = Math.max(0, at * ITEM_HEIGHT - $('list').clientHeight / 2);
}

function showTip(event) {
  const token = event.target.closest('.tok');
  const tip = $('tooltip');
  if (!token) { tip.hidden = true; return; }
  tip.textContent = tokenTip(R[Number(state.sel)], Number(token.dataset.c), Number(token.dataset.k));
  tip.hidden = false;
  const box = token.getBoundingClientRect();
  tip.style.left = Math.min(box.left, window.innerWidth - tip.offsetWidth - 8) + 'px';
  tip.style.top = (box.bottom + 4 + tip.offsetHeight > window.innerHeight ? box.top - tip.offsetHeight - 4 : box.bottom + 4) + 'px';
}

function start() {
  const form = $('filters');
  for (const key of FILTER_KEYS) form.elements[key].value = state[key];
  applyFilters();
  renderTab();
  renderDetail();
}

document.title = `holo view · ${D.title}`;
$('title').textContent = D.title;
renderNotices();
setupFilters();
setupEvents();
start();
