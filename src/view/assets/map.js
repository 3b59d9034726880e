// Shared by gpumem's pages: byte formatting, element creation (text only, never markup) and
// the segment map (every segment a row, its blocks to scale, coloured by state, a block's
// sizes and allocating frames on hover).
'use strict';

window.gpumem = (() => {
  const SVG = 'http://www.w3.org/2000/svg';

  function fmt(bytes) {
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
    let unit = 0;
    while (unit + 1 < units.length && bytes >= 2 ** (10 * (unit + 1))) unit += 1;
    const value = bytes / 2 ** (10 * unit);
    return `${unit === 0 ? value : value.toFixed(2)} ${units[unit]}`;
  }

  function node(tag, attributes, text) {
    const svg = ['svg', 'rect', 'g', 'line', 'title', 'text'].includes(tag);
    const e = svg ? document.createElementNS(SVG, tag) : document.createElement(tag);
    for (const [k, v] of Object.entries(attributes || {})) e.setAttribute(k, String(v));
    if (text !== undefined) e.textContent = String(text);
    return e;
  }

  function stackText(map, index) {
    return index === null || index === undefined ? '' : map.stacks[index].join('\n');
  }

  function drawMap(container, summary, map) {
    const width = 880;
    const row = 16;
    const label = 90;
    const height = Math.max(row, map.segments.length * row);
    const svg = node('svg', {
      viewBox: `0 0 ${width + label} ${height}`,
      'data-event': map.event,
    });
    map.segments.forEach((segment, i) => {
      const [owner, id] = segment.pool_id;
      const isPrivate = owner !== 0 || id !== 0;
      const g = node('g', {
        class: isPrivate ? 'segment private' : 'segment',
        transform: `translate(0 ${i * row})`,
        'data-pool': `${owner},${id}`,
      });
      // A private pool's segments are marked before their size: a graph's own pool "G", a
      // MemPool (or a graph pool shared by captures) "M".
      const mark = isPrivate ? (owner !== 0 ? 'G ' : 'M ') : '';
      g.append(node('text', { x: label - 6, y: row - 4, 'text-anchor': 'end', 'font-size': 11 }, mark + fmt(segment.size)));
      const poolText = isPrivate ? `, private pool (${owner}, ${id})` : '';
      for (const block of segment.blocks) {
        const x = label + (width * block.offset) / segment.size;
        const w = Math.max(0.5, (width * block.size) / segment.size);
        const rect = node('rect', {
          x: x.toFixed(2), y: 1, width: w.toFixed(2), height: row - 2,
          class: `block ${block.state}`, 'data-state': block.state,
        });
        const frames = stackText(map, block.stack);
        const asked = block.state === 'allocated' ? `, ${fmt(block.requested)} requested` : '';
        rect.append(node('title', {}, `${block.state.replace('_', ' ')}: ${fmt(block.size)}${asked}` +
          ` at +${block.offset}, stream ${segment.stream}, ${segment.pool} pool${poolText}${frames ? `\n${frames}` : ''}`));
        g.append(rect);
      }
      svg.append(g);
    });
    container.replaceChildren(svg);
    const left = map.segments_total - map.segments.length;
    const plural = map.segments_total === 1 ? 'segment' : 'segments';
    summary.textContent = `${map.segments_total} ${plural}, ${fmt(map.reserved)} reserved, ` +
      `${fmt(map.allocated)} allocated` + (left > 0 ? ` (${left} segments not drawn)` : '');
  }

  return { fmt, node, drawMap, stackText };
})();
