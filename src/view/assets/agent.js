// The agent's live page: the line-up of each GPU and the process table, redrawn from
// /api/v1/node (one scrape of the agent's metrics) every few seconds. Names from the node
// (pods, configurations) reach the page only as text.
'use strict';

const { fmt, node, drawMap } = window.gpumem;
const $ = (id) => document.getElementById(id);
const EVERY_MS = 2000;
// The allocator whose segments are shown ({uuid, pid}), if any.
let mapOf = null;
// How many times the page has drawn the node, for tests.
window.gpumemDrawn = 0;



function parts(gpu) {
  const out = [];
  for (const p of gpu.processes) {
    out.push({ kind: 'allocated', who: p, bytes: p.allocated, label: `${p.name} (pid ${p.pid}): allocated` });
    out.push({ kind: 'unallocated', who: p, bytes: p.reserved_unallocated, label: `${p.name} (pid ${p.pid}): reserved, not allocated` });
    out.push({ kind: 'outside', who: p, bytes: p.outside, label: `${p.name} (pid ${p.pid}): outside the allocator` });
  }
  out.push({ kind: 'others', bytes: gpu.other_processes, label: 'other processes' });
  out.push({ kind: 'unattributed', bytes: gpu.unattributed, label: 'used, no process charged' });
  // A MIG instance has no driver reservation of its own.
  out.push({ kind: 'driver', bytes: gpu.driver_reserved || 0, label: 'driver reserved' });
  out.push({ kind: 'free', bytes: gpu.free, label: 'free' });
  return out;
}

// One bar: a GPU's or a MIG instance's memory in the parts of its line-up.
function lineup(device) {
  const width = 900;
  const svg = node('svg', { viewBox: `0 0 ${width} 28`, class: 'lineup' });
  const all = parts(device);
  const sum = all.reduce((s, p) => s + p.bytes, 0) || 1;
  let x = 0;
  for (const p of all) {
    if (p.bytes <= 0) continue;
    const w = (width * p.bytes) / sum;
    const rect = node('rect', { x: x.toFixed(2), y: 0, width: w.toFixed(2), height: 28, class: `part ${p.kind}` });
    rect.append(node('title', {}, `${p.label}: ${fmt(p.bytes)}`));
    svg.append(rect);
    x += w;
  }
  return svg;
}

function drawGpu(gpu) {
  const card = node('section', { class: 'gpu', 'data-gpu': gpu.gpu, 'data-uuid': gpu.uuid });
  card.append(node('h2', {}, `GPU ${gpu.gpu}${gpu.model ? ` (${gpu.model})` : ''}: ` +
    `${fmt(gpu.used)} used of ${fmt(gpu.total)}`));
  card.append(lineup(gpu));
  // Reserved memory a sleeping pool unmapped is not on the device: said beside the bar.
  for (const p of gpu.processes.filter((p) => p.not_resident > 0)) {
    card.append(node('p', { class: 'beside', 'data-pid': p.pid, 'data-not-resident': p.not_resident },
      `${p.name} (pid ${p.pid}): ${fmt(p.not_resident)} reserved, not resident ` +
      '(a sleeping pool unmapped it: counted reserved by PyTorch, held nowhere on the device)'));
  }
  // In MIG mode, each GPU instance's own line-up, with the processes on it.
  for (const mig of gpu.migs) {
    const sub = node('div', { class: 'mig', 'data-instance': mig.instance, 'data-mig-uuid': mig.mig_uuid });
    sub.append(node('h3', {}, `GPU instance ${mig.instance} (${mig.profile}): ` +
      `${fmt(mig.used)} used of ${fmt(mig.total)}`));
    sub.append(lineup(mig));
    card.append(sub);
  }
  const table = node('table', { class: 'figures' });
  const row = (name, field, bytes) => {
    const tr = node('tr');
    tr.append(node('th', {}, name));
    tr.append(node('td', { class: 'num', 'data-field': field, 'data-value': bytes }, fmt(bytes)));
    table.append(tr);
  };
  row('total (nvidia-smi)', 'total', gpu.total);
  row('used (nvidia-smi)', 'used', gpu.used);
  for (const p of gpu.processes) {
    row(`${p.name} (pid ${p.pid}): allocated`, `process.${p.pid}.allocated`, p.allocated);
    row(`${p.name} (pid ${p.pid}): reserved, not allocated`, `process.${p.pid}.reserved_unallocated`, p.reserved_unallocated);
    row(`${p.name} (pid ${p.pid}): outside the allocator`, `process.${p.pid}.outside`, p.outside);
  }
  row('other processes', 'other_processes', gpu.other_processes);
  row('used, no process charged', 'unattributed', gpu.unattributed);
  row('driver reserved', 'driver_reserved', gpu.driver_reserved);
  row('free', 'free', gpu.free);
  const details = node('details');
  details.append(node('summary', {}, 'figures'), table);
  card.append(details);
  return card;
}

function drawProcesses(processes) {
  const table = $('processes');
  table.replaceChildren();
  const head = node('tr');
  for (const h of ['GPU', 'pid', 'pod', 'allocator', 'configuration', 'reserved', 'allocated',
    'fragmentation', 'largest free block', 'retries', 'OOMs', '']) {
    head.append(node('th', {}, h));
  }
  table.append(head);
  for (const p of processes) {
    const tr = node('tr', { 'data-pid': p.pid, 'data-uuid': p.uuid });
    const cell = (text, field, value) => {
      const attrs = field ? { 'data-field': field, 'data-value': value } : {};
      if (typeof value === 'number') attrs.class = 'num';
      tr.append(node('td', attrs, text));
    };
    const pod = p.pod_name ? `${p.pod_namespace}/${p.pod_name}${p.container_name ? ` (${p.container_name})` : ''}` : '';
    cell(p.gpu); cell(p.pid);
    cell(pod); tr.lastChild.classList.add('wraps');
    cell(p.allocator);
    cell(p.config || '(default)'); tr.lastChild.classList.add('wraps');
    cell(fmt(p.reserved), 'reserved', p.reserved);
    cell(fmt(p.allocated), 'allocated', p.allocated);
    cell(p.fragmentation === null ? '' : `${(100 * p.fragmentation).toFixed(1)} %`, 'fragmentation', p.fragmentation ?? '');
    cell(p.largest_free_block === null ? '' : fmt(p.largest_free_block), 'largest_free_block', p.largest_free_block ?? '');
    cell(p.retries === null ? '' : String(p.retries), 'retries', p.retries ?? '');
    cell(p.ooms === null ? '' : String(p.ooms), 'ooms', p.ooms ?? '');
    const td = node('td');
    if (p.allocator === 'gpumem') {
      // This process holds the allocator: its segments can be drawn.
      const b = node('button', { type: 'button', class: 'segments' }, 'segments');
      b.addEventListener('click', () => {
        // A MIG device's allocator is known by the MIG device's UUID.
        mapOf = { uuid: p.mig_uuid || p.uuid, pid: p.pid };
        refresh();
      });
      td.append(b);
    }
    tr.append(td);
    table.append(tr);
    // The last OOM, its breakdown and its sentence: a full-width row of their own under the
    // process's, where long text wraps without widening the table.
    if (p.last_oom !== null || p.oom_why || p.recording) {
      const detail = node('td', { colspan: head.children.length });
      if (p.last_oom !== null) {
        let last = `last OOM ${new Date(p.last_oom * 1000).toISOString()}`;
        const kinds = Object.entries(p.oom_breakdown).filter(([, v]) => v > 0)
          .map(([k, v]) => `${k} ${fmt(v)}`);
        if (kinds.length) last += `: ${kinds.join(', ')}`;
        detail.append(node('span', { class: 'last-oom' }, last));
      }
      if (p.oom_why) {
        detail.append(p.last_oom !== null ? '. ' : '', node('span', { class: 'why' }, p.oom_why));
      }
      if (p.recording) {
        // The recording the job uploaded at its OOM, opened at that OOM.
        detail.append(' ', node('a', { href: p.recording, class: 'recording' }, 'recording'));
      }
      const oom = node('tr', { class: 'oom', 'data-oom-of': p.pid, 'data-uuid': p.uuid });
      oom.append(detail);
      table.append(oom);
    }
  }
}

async function refresh() {
  try {
    const response = await fetch('api/v1/node');
    if (!response.ok) throw new Error(`${response.status}: ${await response.text()}`);
    const view = await response.json();
    $('gpus').replaceChildren(...view.gpus.map(drawGpu));
    drawProcesses(view.processes);
    drawAssigned(view.assigned);
    if (mapOf) await refreshMap();
    $('updated').textContent = new Date().toISOString();
    $('error').textContent = '';
    window.gpumemDrawn += 1;
  } catch (error) {
    $('error').textContent = String(error.message || error);
  }
}

function drawAssigned(assigned) {
  $('assignments').hidden = assigned.length === 0;
  const table = $('assigned');
  table.replaceChildren();
  const head = node('tr');
  for (const h of ['GPU', 'MIG device', 'pod', 'claim', 'DRA device']) head.append(node('th', {}, h));
  table.append(head);
  for (const a of assigned) {
    const tr = node('tr', { 'data-uuid': a.uuid, 'data-pod': `${a.pod_namespace}/${a.pod_name}` });
    const pod = `${a.pod_namespace}/${a.pod_name}${a.container_name ? ` (${a.container_name})` : ''}`;
    for (const text of [a.gpu === '' ? '(no GPU of this node resolved)' : a.gpu, a.mig_uuid, pod, a.claim, a.dra_device]) {
      tr.append(node('td', { class: 'wraps' }, text));
    }
    table.append(tr);
  }
}

async function refreshMap() {
  const q = new URLSearchParams(mapOf).toString();
  const response = await fetch(`api/v1/segments?${q}`);
  $('live-map').hidden = false;
  $('map-title').textContent = `Segments of pid ${mapOf.pid} on ${mapOf.uuid}`;
  if (response.status === 202) {
    $('map-summary').textContent = await response.text();
    return;
  }
  if (!response.ok) throw new Error(`${response.status}: ${await response.text()}`);
  drawMap($('map'), $('map-summary'), await response.json());
}

$('every').textContent = String(EVERY_MS / 1000);
refresh();
setInterval(refresh, EVERY_MS);
