// @ts-check
// Talking to `runbus serve`: the token, JSON GETs, and a cap on requests in flight.

import { clock, setStatus } from './dom.js';

const IN_FLIGHT = 4;

// A token given as ?token= is kept for this tab and taken out of the address bar.
const token = (() => {
  const params = new URLSearchParams(location.search);
  const given = params.get('token');
  if (given) {
    sessionStorage.setItem('runbus.token', given);
    params.delete('token');
    const rest = params.toString();
    history.replaceState(null, '', location.pathname + (rest ? '?' + rest : '') + location.hash);
    return given;
  }
  return sessionStorage.getItem('runbus.token');
})();

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// At most IN_FLIGHT requests at once, whatever asks: the rest wait their turn in order.
let running = 0;
const waiting = [];

function acquire() {
  if (running < IN_FLIGHT) {
    running += 1;
    return Promise.resolve();
  }
  return new Promise((resolve) => waiting.push(resolve));
}

function release() {
  const next = waiting.shift();
  if (next) next();
  else running -= 1;
}

// GET `path` with `params` (an array value: the parameter once per item; empty ones left out).
export async function api(path, params = {}) {
  const url = new URL(path, location.origin);
  for (const [name, value] of Object.entries(params)) {
    for (const item of Array.isArray(value) ? value : [value]) {
      if (item !== undefined && item !== null && item !== '') url.searchParams.append(name, String(item));
    }
  }
  const headers = token ? { Authorization: 'Bearer ' + token } : {};
  await acquire();
  let response;
  let body = null;
  try {
    try {
      response = await fetch(url, { headers, cache: 'no-store', credentials: 'same-origin' });
    } catch (error) {
      setStatus('error', 'Server unreachable');
      throw new ApiError(0, 'the server does not answer');
    }
    try {
      body = await response.json();
    } catch (error) {
      body = null;
    }
  } finally {
    release();
  }
  if (!response.ok) throw new ApiError(response.status, (body && body.error) || response.statusText);
  setStatus('ok', 'Updated ' + clock(Date.now() / 1000));
  return body;
}

// For a refresh started by a control or a timer: an API error has been shown in the status
// already; anything else is a bug, and is thrown on.
export function ignoreApiErrors(error) {
  if (!(error instanceof ApiError)) throw error;
}

export function runPath(runId, tail = '') {
  return '/api/runs/' + encodeURIComponent(runId) + tail;
}

// Calls `tick` now and again `every` ms after each call ends, until stopped; not while the tab
// is hidden. Returns {stop, now} (now: run a tick at once, e.g. after a control changed).
export function poll(tick, every) {
  let timer = null;
  let stopped = false;
  let busy = null;
  const loop = async () => {
    clearTimeout(timer);
    if (stopped) return;
    if (!document.hidden) {
      busy = (async () => {
        try {
          await tick();
        } catch (error) {
          if (!(error instanceof ApiError)) throw error;
        }
      })();
      await busy;
      busy = null;
    }
    if (!stopped) timer = setTimeout(loop, every);
  };
  loop();
  return {
    stop() {
      stopped = true;
      clearTimeout(timer);
    },
    async now() {
      if (busy) await busy;
      if (!stopped) loop();
    },
  };
}
