// gpumem view: draws what the server aggregates (a timeline as SVG, one event's segment map
// as JSON at a time). Strings from the recording (frames, names) only ever reach the page as
// text nodes or attribute values, never as markup.
'use strict';

const { fmt, node, drawMap, stackText } = window.gpumem;
const $ = (id) => document.getElementById(id);
const state = { overview: null, device: 0, event: 0, whatIf: '', events: 0 };
// Milliseconds each map took to arrive and draw, for the tests' log.
window.gpumemTimings = [];



async function get(path, kind) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${response.status}: ${await response.text()}`);
  return kind === 'text' ? response.text() : response.json();
}

function query(extra) {
  const q = new URLSearchParams({ device: state.device, ...extra });
  return q.toString();
}

function showError(error) {
  $('error').textContent = error ? String(error.message || error) : '';
}

async function init() {
  const overview = await get('api/v1/recording');
  state.overview = overview;
  $('name').textContent = overview.name;
  document.title = `gpumem view: ${overview.name}`;
  const select = $('device');
  for (const d of overview.devices) select.append(node('option', { value: d.device }, `${d.device}`));
  select.addEventListener('change', () => selectDevice(Number(select.value)));
  $('slider').addEventListener('input', () => setEvent(Number($('slider').value)));
  $('apply').addEventListener('click', () => {
    state.whatIf = $('whatif').value.trim();
    // The comparison replays the trace four times: asked for once the timeline is drawn.
    loadTimeline().then(loadDiff);
    requestMaps();
  });
  if (overview.devices.length === 0) {
    showError('this recording has no trace to view');
    return;
  }
  // An address may name the moment to open at (#device=N&event=E: the agent's links to a
  // job's OOM); else the moment `gpumem explain` chooses (the first OOM of any device, else a
  // device's peak), saying why where the recording has several devices.
  const at = new URLSearchParams(window.location.hash.slice(1));
  const named = overview.devices.find((d) => String(d.device) === at.get('device'));
  const event = at.has('event') ? Number(at.get('event')) : NaN;
  const first = overview.first && overview.devices.find((d) => d.device === overview.first.device);
  if (!named && first && overview.first.why) {
    $('chosen').textContent = overview.first.why;
    $('chosen').hidden = false;
  }
  const device = named || first || overview.devices[0];
  select.value = String(device.device);
  const opening = named ? (Number.isInteger(event) && event >= 0 ? event : null)
    : (first ? overview.first.event : null);
  await selectDevice(device.device, opening);
}

async function selectDevice(device, event = null) {
  state.device = device;
  const d = state.overview.devices.find((x) => x.device === device);
  state.events = d.events;
  // A snapshot without a trace has one moment, the state it holds: shown as event 0.
  $('slider').max = String(Math.max(0, d.events - 1));
  $('slider').disabled = d.events === 0;
  $('events').textContent = d.events === 0 ? '0 (no trace: the state the snapshot holds)' : String(d.events);
  const jumps = $('jumps');
  jumps.replaceChildren();
  const jump = (label, event) => {
    const b = node('button', { type: 'button', class: 'jump', 'data-event': event }, label);
    b.addEventListener('click', () => setEvent(event));
    jumps.append(b);
  };
  if (d.peak !== null) jump('peak', d.peak);
  d.ooms.slice(0, 50).forEach((event, i) => jump(`OOM ${i + 1}`, event));
  await loadTimeline();
  loadDiff();
  const last = Math.max(0, d.events - 1);
  setEvent(event !== null ? Math.min(event, last) : (d.ooms.length ? d.ooms[0] : (d.peak ?? 0)));
}

async function loadTimeline() {
  try {
    const extra = state.whatIf ? { config: state.whatIf } : {};
    const text = await get(`api/v1/timeline.svg?${query(extra)}`, 'text');
    const parsed = new DOMParser().parseFromString(text, 'image/svg+xml');
    const svg = document.importNode(parsed.documentElement, true);
    $('timeline').replaceChildren(svg);
    drawMarker();
    showError(null);
  } catch (error) {
    showError(error);
  }
}

// The recording against the what-if, each at its peak (`gpumem diff --config`). Only the
// latest request's answer is drawn (another device or configuration may have been asked for
// meanwhile); its error is shown in the section's own place.
let diffRequests = 0;
async function loadDiff() {
  const asked = ++diffRequests;
  const current = () => asked === diffRequests;
  $('diff-error').textContent = '';
  if (!state.whatIf) {
    $('diff').hidden = true;
    return;
  }
  try {
    const d = await get(`api/v1/diff?${query({ config: state.whatIf })}`);
    if (current()) drawDiff(d);
  } catch (error) {
    if (!current()) return;
    $('diff').hidden = false;
    $('diff-sentence').textContent = '';
    $('diff-breakdown').replaceChildren();
    $('diff-sites').replaceChildren();
    $('diff-error').textContent = String(error.message || error);
  }
}

function signed(bytes) {
  return bytes > 0 ? `+${fmt(bytes)}` : bytes < 0 ? `-${fmt(-bytes)}` : fmt(0);
}

function drawDiff(d) {
  $('diff').hidden = false;
  $('diff-sentence').textContent = d.sentence;
  const table = $('diff-breakdown');
  table.replaceChildren();
  const head = node('tr');
  for (const h of ['', 'as recorded', 'what-if', 'difference']) head.append(node('th', {}, h));
  table.append(head);
  const row = (name, a, b) => {
    const tr = node('tr', { 'data-part': name });
    tr.append(node('th', {}, name), cell(fmt(a), true), cell(fmt(b), true), cell(signed(b - a), true));
    table.append(tr);
  };
  const parts = [
    ['live tensors (requested)', 'requested'],
    ['rounding of live tensors', 'rounding'],
    ['cached free, main stream', 'fragmented'],
    ['cached free, other streams', 'other_streams'],
    ['cached free, private pools', 'other_pools'],
    ['freed, waiting on other streams', 'pending_stream_frees'],
  ];
  for (const [name, key] of parts) row(name, d.a.breakdown[key], d.b.breakdown[key]);
  row('reserved at the peak', d.a.peak_reserved.bytes, d.b.peak_reserved.bytes);
  const sites = $('diff-sites');
  sites.replaceChildren();
  const changed = d.sites.filter((s) => s.difference !== 0).slice(0, 10);
  if (!changed.length) return;
  const top = node('tr');
  for (const h of ['difference', 'as recorded', 'what-if', 'live tensors allocated at']) top.append(node('th', {}, h));
  sites.append(top);
  for (const s of changed) {
    const tr = node('tr');
    tr.append(cell(signed(s.difference), true), cell(fmt(s.a.bytes), true), cell(fmt(s.b.bytes), true), cell(s.site));
    sites.append(tr);
  }
}

function drawMarker() {
  const svg = $('timeline').querySelector('svg');
  if (!svg) return;
  const left = Number(svg.dataset.left);
  const width = Number(svg.dataset.width);
  const xmax = Number(svg.dataset.xmax) || 1;
  const top = Number(svg.dataset.top);
  const height = Number(svg.dataset.height);
  const x = left + (width * state.event) / xmax;
  let marker = svg.querySelector('#marker');
  if (!marker) {
    marker = node('line', { id: 'marker', stroke: '#000', 'stroke-width': 1 });
    svg.append(marker);
  }
  for (const [k, v] of Object.entries({ x1: x, x2: x, y1: top, y2: top + height })) {
    marker.setAttribute(k, String(v));
  }
}

function setEvent(event) {
  state.event = Math.max(0, Math.min(event, state.events - 1));
  $('slider').value = String(state.event);
  $('event').textContent = String(state.event);
  drawMarker();
  requestMaps();
}

// One request at a time; a slider moved meanwhile asks again for where it ended.
let inflight = false;
let again = false;

async function requestMaps() {
  if (inflight) {
    again = true;
    return;
  }
  inflight = true;
  try {
    do {
      again = false;
      const event = state.event;
      const started = performance.now();
      // A map that cannot be drawn (a replay that left the recording) does not keep the
      // explanation from showing: its error is shown beside it.
      let mapError = null;
      try {
        const recorded = await get(`api/v1/segments?${query({ event })}`);
        drawMap($('map-recorded'), $('summary-recorded'), recorded);
        drawTop(recorded);
        $('map-event').textContent = String(event);
        const column = $('whatif-column');
        column.hidden = !state.whatIf;
        if (state.whatIf) {
          const other = await get(`api/v1/segments?${query({ event, config: state.whatIf })}`);
          $('whatif-title').textContent = state.whatIf;
          drawMap($('map-whatif'), $('summary-whatif'), other);
        }
        window.gpumemTimings.push(performance.now() - started);
      } catch (error) {
        mapError = error;
      }
      const d = state.overview.devices.find((x) => x.device === state.device);
      if (d.ooms.includes(event) || d.events === 0) {
        drawExplain(await get(`api/v1/explain?${query({ event })}`));
      } else {
        $('explain').hidden = true;
      }
      showError(mapError);
    } while (again);
  } catch (error) {
    showError(error);
  } finally {
    inflight = false;
  }
  // The slider moved while a request failed: draw where it ended.
  if (again) requestMaps();
}



function cell(text, numeric) {
  return node('td', numeric ? { class: 'num' } : {}, text);
}

function drawTop(map) {
  const table = $('top');
  table.replaceChildren();
  const head = node('tr');
  for (const h of ['size', 'requested', 'allocated at']) head.append(node('th', {}, h));
  table.append(head);
  for (const b of map.top) {
    const tr = node('tr');
    tr.append(cell(fmt(b.size), true), cell(fmt(b.requested), true));
    const frames = node('td', { class: 'frames' }, stackText(map, b.stack) || '(no stack recorded)');
    tr.append(frames);
    table.append(tr);
  }
}

function drawExplain(e) {
  $('explain').hidden = false;
  $('sentence').textContent = e.sentence;
  $('cause').textContent = e.cause_sentence;
  $('cause').dataset.cause = e.cause || '';
  const parts = [
    ['live tensors (requested)', e.breakdown.requested],
    ['rounding of live tensors', e.breakdown.rounding],
    ['cached, free, too small for the request', e.breakdown.fragmented],
    ["cached, free, other streams' pools", e.breakdown.other_streams],
    ['cached, free, other pools (CUDA graphs, MemPools)', e.breakdown.other_pools],
    ['freed, waiting on other streams', e.breakdown.pending_stream_frees],
    ['free on the device', e.breakdown.free],
    ['outside the allocator', e.breakdown.outside_allocator],
  ];
  const table = $('breakdown');
  table.replaceChildren();
  for (const [name, bytes] of parts) {
    const tr = node('tr', { 'data-part': name });
    tr.append(node('th', {}, name), cell(bytes === null ? 'unknown' : fmt(bytes), true));
    table.append(tr);
  }
  const pools = $('private-pools');
  pools.replaceChildren();
  if (e.private_pools.length) {
    pools.append(node('caption', {}, 'Private pools: only their own requests use them'));
    const head = node('tr');
    for (const h of ['private pool', 'kind', 'segments', 'reserved', 'cached free']) head.append(node('th', {}, h));
    pools.append(head);
    for (const p of e.private_pools) {
      const tr = node('tr', { 'data-pool': p.id.join(',') });
      const kind = p.kind === 'graph' ? "a CUDA graph's own pool" : 'a MemPool or shared graph pool';
      tr.append(cell(`(${p.id[0]}, ${p.id[1]})`), cell(kind), cell(p.segments, true),
        cell(fmt(p.reserved), true), cell(fmt(p.free), true));
      pools.append(tr);
    }
  }
  const candidates = $('candidates');
  candidates.replaceChildren();
  if (e.candidates.length) {
    const head = node('tr');
    for (const h of ['configuration', 'OOMs', 'peak reserved']) head.append(node('th', {}, h));
    candidates.append(head);
    for (const c of e.candidates) {
      const tr = node('tr');
      tr.append(cell(c.config), cell(c.ooms, true), cell(fmt(c.peak_reserved), true));
      candidates.append(tr);
    }
  }
  // What the repeating iterations keep past their ends, by where it was allocated.
  const growth = $('growth');
  growth.replaceChildren();
  const g = e.growth;
  if (g && g.kept_at.length) {
    growth.append(node('caption', {}, `${g.iterations} iterations of ${g.allocations_per_iteration} ` +
      `allocations; each keeps ${fmt(g.kept_per_iteration)} past its end` +
      (g.fills_at_iteration === null ? '' : `; the memory fills in iteration ${g.fills_at_iteration}`)));
    const head = node('tr');
    for (const h of ['kept memory allocated at', 'allocations', 'bytes']) head.append(node('th', {}, h));
    growth.append(head);
    for (const k of g.kept_at) {
      const tr = node('tr', { 'data-frame': k.frame });
      tr.append(cell(k.frame), cell(k.allocations, true), cell(fmt(k.bytes), true));
      growth.append(tr);
    }
  }
}

init().catch(showError);
