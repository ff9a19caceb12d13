// corral: send node's built-in fetch() through the box's egress proxy (network allowlist).
//
// Node 20's fetch (its bundled undici) ignores HTTP_PROXY/HTTPS_PROXY. corral copies this file
// into the box's network directory and loads it into every node process with
// NODE_OPTIONS=--require. On the first fetch() call it replaces
// undici's global dispatcher with an Agent of the same (bundled) class whose connect() opens
// a CONNECT tunnel through the proxy, then TLS on top for https. NO_PROXY hosts connect
// directly. A refusal by the proxy rejects fetch() with the proxy's message as its cause.
'use strict';

(() => {
  const env = process.env;
  const proxyUrl = env.HTTPS_PROXY || env.https_proxy || env.HTTP_PROXY || env.http_proxy;
  if (!proxyUrl || typeof globalThis.fetch !== 'function') return;
  let proxy;
  try {
    proxy = new URL(proxyUrl);
  } catch {
    return;
  }
  const net = require('net');
  const tls = require('tls');
  const proxyHost = proxy.hostname.replace(/^\[|\]$/g, '');
  const proxyPort = Number(proxy.port) || 80;
  const noProxy = (env.NO_PROXY || env.no_proxy || '')
    .split(',')
    .map((s) => s.trim().toLowerCase())
    .filter(Boolean);
  const DISPATCHER = Symbol.for('undici.globalDispatcher.1');

  function bypass(host) {
    const h = host.replace(/^\[|\]$/g, '').toLowerCase();
    return noProxy.some((p) => p === '*' || h === p || h.endsWith(p.startsWith('.') ? p : '.' + p));
  }

  function tunnel(opts, callback) {
    const secure = opts.protocol === 'https:';
    const host = String(opts.hostname).replace(/^\[|\]$/g, '');
    const port = Number(opts.port) || (secure ? 443 : 80);
    let done = false;
    const finish = (err, sock) => {
      if (done) return;
      done = true;
      callback(err, sock);
    };
    const ready = (sock) => {
      if (!secure) return finish(null, sock);
      const servername = opts.servername || host;
      const secured = tls.connect({
        socket: sock,
        servername: net.isIP(servername) ? undefined : servername,
        ALPNProtocols: ['http/1.1'],
      });
      secured.once('secureConnect', () => finish(null, secured));
      secured.once('error', (err) => finish(err));
    };
    if (bypass(host)) {
      const direct = net.connect({ host, port });
      direct.once('connect', () => ready(direct));
      direct.once('error', (err) => finish(err));
      return;
    }
    const sock = net.connect({ host: proxyHost, port: proxyPort });
    let head = Buffer.alloc(0);
    const onData = (chunk) => {
      head = Buffer.concat([head, chunk]);
      const end = head.indexOf('\r\n\r\n');
      if (end < 0) {
        if (head.length > 65536) sock.destroy(new Error('corral proxy: reply head too large'));
        return;
      }
      sock.removeListener('data', onData);
      sock.pause();
      const status = Number(head.subarray(0, end).toString('latin1').split(' ')[1]);
      const rest = head.subarray(end + 4);
      if (status === 200) {
        if (rest.length) sock.unshift(rest);
        ready(sock);
        return;
      }
      const message = rest.toString('utf8').trim() || `HTTP ${status}`;
      sock.destroy();
      finish(new Error(`proxy refused ${host}:${port} (HTTP ${status}): ${message}`));
    };
    sock.once('connect', () => {
      const target = net.isIPv6(host) ? `[${host}]:${port}` : `${host}:${port}`;
      sock.write(`CONNECT ${target} HTTP/1.1\r\nHost: ${target}\r\n\r\n`);
    });
    sock.on('data', onData);
    sock.once('error', (err) => finish(err));
    sock.once('close', () => finish(new Error(`proxy closed the tunnel to ${host}:${port}`)));
  }

  let installed = false;
  function install() {
    if (installed) return;
    installed = true;
    try {
      void globalThis.Headers; // loads the bundled undici, which creates its default Agent
      const current = globalThis[DISPATCHER];
      const Agent = current && current.constructor;
      if (typeof Agent === 'function') globalThis[DISPATCHER] = new Agent({ connect: tunnel });
    } catch {
      // leave fetch as it is: it fails as it would have without corral
    }
  }

  const original = globalThis.fetch;
  globalThis.fetch = function fetch(input, init) {
    install();
    return original.call(this, input, init);
  };
})();
