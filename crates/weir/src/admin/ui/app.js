// weir dashboard: polls the admin API (/v1/...) with the token the user gave
// and draws plain SVG. No library, no inline script (the page's CSP forbids it).
'use strict';

const POLL_MS = 1000;        // services, tenants and tables
const CONNS_MS = 5000;       // connection list, when "refresh" is ticked
const WINDOW_S = 300;        // plots show the last 5 minutes
const PALETTE = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#17becf'];
const KEY = 'weir-token';

const $ = (id) => document.getElementById(id);
const state = {
  token: null,
  who: null,        // GET /v1/whoami: {role, tenant, can_write}
  history: {},      // "tenant/service|backend" -> [{t, cps, inpps, outpps, inbps, outbps}]
  cursor: null,     // cursor of the connection page shown (null: first page)
  nextCursor: null,
  pageNo: 1,
  connSeq: 0,
  gen: 0,           // bumped when the token changes: late answers for the old one are dropped
  timers: [],
};
// For tests and the curious: the plotted samples.
window.weirDashboard = state;

// ---- token ------------------------------------------------------------------

// `/ui/?token=T` stores T for this tab and removes it from the address bar
// (and so from the history and from anything copied from it).
function takeTokenFromUrl() {
  const url = new URL(window.location.href);
  const t = url.searchParams.get('token');
  if (t === null) return;
  url.searchParams.delete('token');
  history.replaceState(null, '', url.pathname + url.search + url.hash);
  if (t !== '') sessionStorage.setItem(KEY, t);
}

function showLogin(message) {
  stop();
  // Nothing seen with the old token stays on the page or in memory.
  state.gen++;
  state.token = null;
  state.who = null;
  state.history = {};
  state.cursor = state.nextCursor = null;
  state.pageNo = 1;
  for (const sel of ['#services', '#tenants tbody', '#conns tbody']) document.querySelector(sel).replaceChildren();
  sessionStorage.removeItem(KEY);
  $('main').hidden = true;
  $('logout').hidden = true;
  $('who').textContent = '';
  $('login').hidden = false;
  showError(message || '');
  $('token').focus();
}

function showError(message) {
  $('error').textContent = message;
  $('error').hidden = !message;
}

// ---- API ----------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(method, path, body) {
  const opts = { method, headers: { Authorization: 'Bearer ' + state.token }, cache: 'no-store' };
  if (body !== undefined) {
    opts.headers['Content-Type'] = 'application/json';
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(path, opts);
  const text = await r.text();
  let v = null;
  try { v = text ? JSON.parse(text) : null; } catch (_) { v = null; }
  if (!r.ok) {
    const msg = (v && v.message) || (r.status + ' ' + r.statusText);
    if (r.status === 401) showLogin('The token was refused: ' + msg);
    throw new ApiError(r.status, msg);
  }
  return v;
}

// ---- start and stop -------------------------------------------------------------

async function start() {
  state.token = sessionStorage.getItem(KEY);
  if (!state.token) { showLogin(''); return; }
  try {
    state.who = await api('GET', '/v1/whoami');
  } catch (e) {
    if (e.status !== 401) showError('Cannot reach the admin API: ' + e.message);
    return;
  }
  const w = state.who;
  $('who').textContent = w.role === 'tenant' ? 'tenant ' + w.tenant : w.role === 'readonly' ? 'read-only' : 'full access';
  $('login').hidden = true;
  $('main').hidden = false;
  $('logout').hidden = false;
  const tenantField = document.querySelector('#filters [name=tenant]');
  tenantField.readOnly = !!w.tenant;   // the API pins a tenant token's filter anyway
  if (w.tenant) tenantField.value = w.tenant;
  showError('');
  await poll();
  await loadConns();
  state.timers.push(setInterval(poll, POLL_MS));
  state.timers.push(setInterval(() => { if ($('auto').checked) loadConns(); }, CONNS_MS));
}

function stop() {
  state.timers.forEach(clearInterval);
  state.timers = [];
}

// ---- services, backends, plots ----------------------------------------------------

let polling = false;
async function poll() {
  if (polling) return;   // a slow answer: skip a tick rather than pile up
  polling = true;
  const gen = state.gen;
  try {
    const [services, tenants, tables] = await Promise.all([
      api('GET', '/v1/services'), api('GET', '/v1/tenants'), api('GET', '/v1/table'),
    ]);
    if (gen !== state.gen) return;
    record(services, Date.now() / 1000);
    renderServices(services);
    renderTenants(tenants, tables);
    $('status').textContent = 'updated ' + new Date().toLocaleTimeString();
    showError('');
  } catch (e) {
    if (e.status !== 401) showError('Polling the admin API failed: ' + e.message);
  } finally {
    polling = false;
  }
}

function record(services, now) {
  const seen = new Set();
  for (const s of services) {
    for (const b of s.backends) {
      const key = s.tenant + '/' + s.name + '|' + b.address;
      seen.add(key);
      const h = state.history[key] || (state.history[key] = []);
      h.push(Object.assign({ t: now }, b.rates));
      while (h.length && h[0].t < now - WINDOW_S) h.shift();
    }
  }
  // Forget backends that are gone, so memory stays bounded.
  for (const key of Object.keys(state.history)) if (!seen.has(key)) delete state.history[key];
}

function el(tag, attrs, ...children) {
  const svg = ['svg', 'polyline', 'rect', 'line', 'text', 'title', 'g'].includes(tag);
  const e = svg ? document.createElementNS('http://www.w3.org/2000/svg', tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function human(n) {
  const units = ['', 'K', 'M', 'G', 'T', 'P'];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return (i === 0 ? String(Math.round(n)) : n.toFixed(n < 10 ? 1 : 0)) + units[i];
}

// One plot: a line per series over the last `span` seconds, scaled to the
// largest value shown. `series`: [{color, dashed, points: [{t, v}]}].
function plot(title, series, now, span) {
  const W = 330, H = 90, PAD = 4;
  let max = 0, samples = 0;
  for (const s of series) for (const p of s.points) { max = Math.max(max, p.v); samples++; }
  const top = max > 0 ? max * 1.1 : 1;
  const svg = el('svg', { viewBox: `0 0 ${W} ${H}`, class: 'plot-svg', 'data-max': max, 'data-samples': samples });
  for (const s of series) {
    const pts = s.points.map((p) => {
      const x = PAD + (W - 2 * PAD) * (1 - (now - p.t) / span);
      const y = H - PAD - (H - 2 * PAD) * (p.v / top);
      return x.toFixed(1) + ',' + y.toFixed(1);
    }).join(' ');
    const attrs = { points: pts, fill: 'none', stroke: s.color, 'stroke-width': 1.5 };
    if (s.dashed) attrs['stroke-dasharray'] = '4 2';
    svg.append(el('polyline', attrs));
  }
  return el('div', { class: 'plot', 'data-plot': title },
    el('div', { class: 'caption' }, el('span', {}, title), el('span', {}, 'max ' + human(max))),
    svg);
}

function renderServices(services) {
  const now = Date.now() / 1000;
  // The x axis spans the samples kept (at least 10 s, at most WINDOW_S), so a
  // page opened a minute ago uses its whole width.
  let oldest = now;
  for (const h of Object.values(state.history)) if (h.length) oldest = Math.min(oldest, h[0].t);
  const span = Math.min(WINDOW_S, Math.max(10, now - oldest));
  $('window').textContent = `(rates over the last ${Math.round(span)} s; up to ${WINDOW_S / 60} minutes kept)`;
  const root = $('services');
  root.replaceChildren();
  if (!services.length) root.append(el('p', { class: 'muted' }, 'No services.'));
  for (const s of services) {
    const id = s.tenant + '/' + s.name;
    const card = el('div', { class: 'card', 'data-service': id });
    card.append(el('h3', {}, id + ' ', el('span', { class: 'muted' },
      `${s.protocol.toUpperCase()} ${s.listen}  scheduler ${s.scheduler}` +
      (s.persistence && s.persistence !== '0s' ? `  persistence ${s.persistence}` : ''))));
    const rows = s.backends.map((b, i) => el('tr', { 'data-backend': b.address },
      el('td', {}, el('span', { class: 'swatch c' + (i % PALETTE.length) }), b.address),
      el('td', { class: b.health }, b.health), el('td', {}, b.weight),
      el('td', {}, b.active_conns), el('td', {}, b.inactive_conns),
      el('td', {}, human(b.stats.conns)), el('td', {}, human(b.rates.cps)),
      el('td', {}, human(b.rates.inpps)), el('td', {}, human(b.rates.outpps)),
      el('td', {}, human(b.rates.inbps)), el('td', {}, human(b.rates.outbps))));
    card.append(el('table', {},
      el('thead', {}, el('tr', {}, ...['backend', 'health', 'weight', 'active', 'inactive', 'conns',
        'conns/s', 'pkts/s in', 'pkts/s out', 'bytes/s in', 'bytes/s out'].map((h) => el('th', {}, h)))),
      el('tbody', {}, ...rows)));
    const hist = s.backends.map((b) => state.history[id + '|' + b.address] || []);
    const lines = (field, dashed) => s.backends.map((b, i) => ({
      color: PALETTE[i % PALETTE.length], dashed,
      points: hist[i].map((p) => ({ t: p.t, v: p[field] })),
    }));
    card.append(el('div', { class: 'plots' },
      plot('new connections/s', lines('cps', false), now, span),
      plot('packets/s (solid in, dashed out)', [...lines('inpps', false), ...lines('outpps', true)], now, span),
      plot('bytes/s (solid in, dashed out)', [...lines('inbps', false), ...lines('outbps', true)], now, span)));
    root.append(card);
  }
}

// ---- tenants and flow tables ----------------------------------------------------------

// Chain-length histogram as bars, log-scaled (empty buckets dwarf the rest);
// hover a bar for its exact count.
function histogram(h) {
  if (!h || !h.length) return el('span', { class: 'muted' }, '—');
  const W = 120, H = 22, bw = W / h.length;
  const top = Math.log10(1 + Math.max(...h));
  const svg = el('svg', { viewBox: `0 0 ${W} ${H}`, class: 'hist' });
  h.forEach((n, i) => {
    const bh = top > 0 ? (H - 1) * Math.log10(1 + n) / top : 0;
    const label = (i === h.length - 1 ? '≥' : '') + i;
    svg.append(el('rect', { x: i * bw, y: H - bh, width: Math.max(bw - 1, 1), height: bh, fill: '#1f77b4' },
      el('title', {}, `chain length ${label}: ${n} buckets`)));
  });
  return svg;
}

function renderTenants(tenants, tables) {
  const byName = Object.fromEntries(tables.map((t) => [t.tenant, t]));
  const body = document.querySelector('#tenants tbody');
  body.replaceChildren(...tenants.map((t) => {
    const tb = byName[t.name] || {};
    return el('tr', { 'data-tenant': t.name },
      el('td', {}, t.name), el('td', {}, t.active_conns), el('td', {}, t.refused),
      el('td', {}, tb.placement || t.table), el('td', {}, tb.entries ?? '—'), el('td', {}, tb.buckets ?? '—'),
      el('td', {}, tb.load_factor === undefined ? '—' : tb.load_factor.toFixed(3)),
      el('td', {}, tb.max_chain ?? '—'), el('td', {}, histogram(tb.chain_histogram)),
      el('td', {}, tb.refused_inserts ?? '—'));
  }));
}

// ---- connections ------------------------------------------------------------------------

function connQuery(cursor) {
  const q = new URLSearchParams();
  for (const [k, v] of new FormData($('filters'))) if (String(v).trim()) q.set(k, String(v).trim());
  if (cursor) q.set('cursor', cursor);
  return '/v1/connections?' + q.toString();
}

async function loadConns() {
  // Answers can overtake each other (auto refresh, a click): show the latest asked.
  const seq = ++state.connSeq;
  const gen = state.gen;
  const query = connQuery(state.cursor);
  let page;
  try {
    page = await api('GET', query);
  } catch (e) {
    if (e.status !== 401 && seq === state.connSeq) showError('Listing connections failed: ' + e.message);
    return;
  }
  if (seq !== state.connSeq || gen !== state.gen) return;
  $('conns').dataset.query = query;
  state.nextCursor = page.next;
  $('next').disabled = !page.next;
  $('page').textContent = `page ${state.pageNo}, ${page.connections.length} connection(s)` +
    (page.next ? ', more follow' : '');
  const canKill = state.who && state.who.can_write;
  const body = document.querySelector('#conns tbody');
  body.replaceChildren(...page.connections.map((c) => {
    const kill = el('td', {});
    // Cookies are counted from 1, so they stay exact in a JS number; refuse to
    // kill by a rounded one all the same.
    if (canKill && Number.isSafeInteger(c.cookie)) {
      const b = el('button', { type: 'button', class: 'kill' }, 'kill');
      b.addEventListener('click', () => killConn(c));
      kill.append(b);
    }
    return el('tr', { 'data-cookie': c.cookie },
      el('td', {}, c.tenant), el('td', {}, c.service), el('td', {}, c.proto), el('td', {}, c.client),
      el('td', {}, c.virtual), el('td', {}, c.backend), el('td', {}, c.state), el('td', {}, c.expires_s + 's'),
      el('td', {}, human(c.bytes_in)), el('td', {}, human(c.bytes_out)), el('td', {}, c.cookie), kill);
  }));
}

async function killConn(c) {
  if (!window.confirm(`Kill ${c.proto} ${c.client} -> ${c.backend} (${c.tenant}/${c.service})?`)) return;
  try {
    await api('DELETE', '/v1/connections/' + c.cookie);
  } catch (e) {
    if (e.status !== 401) showError('Kill failed: ' + e.message);
  }
  await loadConns();
}

// ---- wiring -------------------------------------------------------------------------------

document.addEventListener('DOMContentLoaded', () => {
  $('login').addEventListener('submit', (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $('token').value.trim());
    $('token').value = '';
    start();
  });
  $('logout').addEventListener('click', () => showLogin('Token forgotten.'));
  $('filters').addEventListener('submit', (ev) => {
    ev.preventDefault();
    state.cursor = null;
    state.pageNo = 1;
    loadConns();
  });
  $('first').addEventListener('click', () => { state.cursor = null; state.pageNo = 1; loadConns(); });
  $('next').addEventListener('click', () => {
    if (!state.nextCursor) return;
    state.cursor = state.nextCursor;
    state.pageNo++;
    loadConns();
  });
  takeTokenFromUrl();
  start();
});
