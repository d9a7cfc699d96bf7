// @ts-check
// The hardware tab of a run page: the distinct hardware of its labels (how many labels have
// each), then every label's machine, software versions, git state and command line.

import { labelColor } from './colors.js';
import { count, el, swatch } from './dom.js';

/**
 * "8 × NVIDIA H100 80GB HBM3 (81,559 MB)": a label's GPUs, alike ones counted together.
 * @param {Array<{name?: string, memory_total_mb?: number}>|null} gpus
 */
export function gpuSummary(gpus) {
  if (!gpus) return '–';
  if (!gpus.length) return 'none';
  const kinds = new Map();
  for (const gpu of gpus) {
    const name = String(gpu.name ?? 'GPU') + (gpu.memory_total_mb ? ' (' + count(Math.round(gpu.memory_total_mb)) + ' MB)' : '');
    kinds.set(name, (kinds.get(name) || 0) + 1);
  }
  return [...kinds].map(([name, n]) => n + ' × ' + name).join(', ');
}

/**
 * The distinct hardware (how many labels have each), then every label's.
 * @param {{labels: any[], groups: any[], total: number}} hardware as sources.labelHardware gives it
 */
export function hardwareView({ labels, groups, total }) {
  if (!labels.length) return [el('p', { class: 'empty' }, 'No labels yet.')];
  const alike = groups.length ? el('div', { class: 'hw-groups', id: 'hardware-groups' }, groups.map(hardwareGroup)) : null;
  const more = total > labels.length ? el('p', { class: 'muted' }, 'The first ' + count(labels.length) + ' of ' + count(total) + ' labels.') : null;
  return [alike, hardwareTable(labels), more].filter(Boolean);
}

function hardwareGroup(group) {
  return el('div', { class: 'hw-group' },
    el('span', { class: 'hw-count' }, count(group.count) + (group.count === 1 ? ' label' : ' labels')),
    el('span', null, gpuSummary(group.gpus)),
    [['driver', group.driver], ['CUDA', group.cuda], ['torch', group.torch], ['Python', group.python], ['CPUs', group.cpus]]
      .filter(([, text]) => text !== null && text !== undefined)
      .map(([name, text]) => el('span', { class: 'muted' }, name + ' ', el('span', { class: 'mono' }, String(text)))));
}

function hardwareTable(rows) {
  const head = ['Label', 'Rank', 'Host', 'GPUs', 'Driver', 'CUDA', 'torch', 'Python', 'Git', 'Command line'];
  return el('table', { class: 'table hardware-table' },
    el('thead', null, el('tr', null, head.map((h) => el('th', null, h)))),
    el('tbody', null, rows.map((row) => el('tr', { dataset: { label: row.label } },
      el('td', { class: 'mono nowrap' }, swatch(labelColor(row.label)), row.label),
      el('td', { class: 'num' }, row.rank ?? '–'),
      el('td', { class: 'mono hw-host' }, row.host ?? '–'),
      el('td', { class: 'hw-gpus' }, gpuSummary(row.gpus)),
      el('td', { class: 'mono' }, row.driver ?? '–'),
      el('td', { class: 'mono' }, row.cuda ?? '–'),
      el('td', { class: 'mono' }, row.torch ?? '–'),
      el('td', { class: 'mono' }, row.python ?? '–'),
      gitCell(row.git),
      el('td', { class: 'mono hw-argv' }, row.argv ? row.argv.map(String).join(' ') : '–')))));
}

// A label's working directory at its start: short commit, branch, dirty; the full commit and
// the origin URL (its credentials hidden by the API) on hover.
function gitCell(git) {
  if (!git) return el('td', { class: 'mono hw-git' }, '–');
  const commit = typeof git.commit === 'string' ? git.commit : null;
  const title = [commit, git.remote].filter((part) => typeof part === 'string').join('\n');
  return el('td', { class: 'mono hw-git nowrap', title: title || null },
    commit ? commit.slice(0, 7) : '?',
    ' ', el('span', { class: 'muted' }, typeof git.branch === 'string' ? git.branch : 'detached'),
    git.dirty === true ? [' ', el('span', { class: 'badge hw-dirty' }, 'dirty')] : null);
}
