/* rayeval report: the board, curves over training, items and A against B.
 * One app for the file `rayeval report` writes (its views embedded in #rayeval-views) and
 * the page `rayeval view` serves (views fetched from api/NAME?QUERY). It never computes an
 * interval: every interval shown is the store's or rayeval's (paired, exact). It counts
 * items and runs McNemar's exact test on those counts. Every text from the store goes in
 * through textContent, never as markup.
 *
 * The app is split by view, one file each, joined in this order inside one function (the
 * page's <script>, reporting/report_page.py): app.js (the state, the data, the DOM helpers,
 * the frame), board.js, curves.js, items.js, compare.js, about.js, start.js. Every file
 * shares the one scope: a name defined in one is used in the others. */
  var EMBEDDED = document.getElementById('rayeval-views');
  var VIEWS = EMBEDDED ? JSON.parse(EMBEDDED.textContent) : null;
  var PAGE = 100;        // board rows and items per page: a 14,000-item list paints 100
  var cache = {};
  var S = { meta: null, board: null, route: {}, order: null };

  // --- data ----------------------------------------------------------------------------
  function get(path) {
    if (path in cache) return cache[path];
    var p;
    if (VIEWS) {
      p = Promise.resolve(path in VIEWS ? VIEWS[path] : null);
    } else {
      p = fetch('api/' + path).then(function (r) {
        return r.json().then(function (body) {
          if (!r.ok) throw new Error(body.error || r.statusText);
          return body;
        });
      });
    }
    cache[path] = p;
    return p;
  }
  function pairedOf(ref, names) {
    // a file holds every column's differences to a reference; rayeval view computes those of
    // the columns shown (all 300 of a 100,000-cell store took 16 s)
    return q('paired', VIEWS || !names ? { ref: ref } : { ref: ref, columns: JSON.stringify(names) });
  }

  function q(name, params) {
    var parts = Object.keys(params).map(function (k) {
      return k + '=' + (VIEWS ? params[k] : encodeURIComponent(params[k]));
    });
    return name + (parts.length ? '?' + parts.join('&') : '');
  }

  // --- small DOM helpers ---------------------------------------------------------------
  function el(tag, attrs, children) {
    var n = document.createElement(tag);
    if (attrs) Object.keys(attrs).forEach(function (k) {
      var v = attrs[k];
      if (v === null || v === undefined || v === false) return;
      if (k === 'text') n.textContent = v;
      else if (k === 'on') Object.keys(v).forEach(function (e) { n.addEventListener(e, v[e]); });
      else if (k === 'style') n.setAttribute('style', v);
      else n.setAttribute(k, v === true ? '' : v);
    });
    (children || []).forEach(function (c) {
      if (c === null || c === undefined) return;
      n.appendChild(typeof c === 'string' ? document.createTextNode(c) : c);
    });
    return n;
  }
  function clear(n) { while (n.firstChild) n.removeChild(n.firstChild); return n; }
  function fmt(v, digits) {
    if (v === null || v === undefined || (typeof v === 'number' && isNaN(v))) return '-';
    return Number(v).toFixed(digits === undefined ? 4 : digits);
  }
  function pct(level) { return level ? Math.round(level * 1000) / 10 + '%' : ''; }
  function glob(pattern) {
    var re = pattern.replace(/[.+^${}()|[\]\\]/g, '\\$&').replace(/\*/g, '.*').replace(/\?/g, '.');
    return new RegExp(pattern.indexOf('*') < 0 && pattern.indexOf('?') < 0 ? re : '^' + re + '$', 'i');
  }
  function go(view, params) {
    var parts = Object.keys(params || {}).filter(function (k) {
      return params[k] !== '' && params[k] !== null && params[k] !== undefined;
    }).map(function (k) { return k + '=' + encodeURIComponent(params[k]); });
    location.hash = '#' + view + (parts.length ? '?' + parts.join('&') : '');
  }
  function route() {
    var h = location.hash.replace(/^#/, '');
    var i = h.indexOf('?');
    var r = { view: (i < 0 ? h : h.slice(0, i)) || 'board' };
    if (i >= 0) h.slice(i + 1).split('&').forEach(function (kv) {
      var j = kv.indexOf('=');
      if (j > 0) r[kv.slice(0, j)] = decodeURIComponent(kv.slice(j + 1));
    });
    return r;
  }
  function setParam(k, v) { var r = route(); r[k] = v; var view = r.view; delete r.view; go(view, r); }
  function entryLabel(i) {
    var e = S.board.entries[i];
    var several = S.meta.sweeps.length > 1;
    return (several ? e.sweep + ' / ' : '') + e.name + (e.step !== null ? ' (step ' + e.step + ')' : '');
  }

  // --- the frame -----------------------------------------------------------------------
  var VIEWS_SHOWN = [['board', 'Board'], ['curves', 'Curves'], ['items', 'Items'],
                     ['compare', 'A vs B'], ['about', 'Provenance']];
  function frame() {
    var title = document.getElementById('title');
    var nav = clear(document.getElementById('nav'));
    var r = route();
    VIEWS_SHOWN.forEach(function (v) {
      nav.appendChild(el('a', { href: '#' + v[0], 'class': r.view === v[0] ? 'on' : null,
                                text: v[1] }));
    });
    var m = S.meta;
    title.textContent = 'rayeval: ' + m.sweeps.join(', ') +
      (m.filters.evaluation ? ' on ' + m.filters.evaluation : '');
    document.title = title.textContent;
    var sub = clear(document.getElementById('subtitle'));
    sub.appendChild(document.createTextNode(
      m.checkpoints + ' checkpoint(s), ' + m.evaluations.length + ' evaluation(s), ' +
      m.cells + ' cell(s); intervals: ' + pct(m.level) + ' bootstrap; store ' + m.store));
  }

  function render() {
    var r = route();
    S.route = r;
    frame();
    // each render draws into its own container: a view that finishes after the reader moved
    // on draws into a node no longer in the page
    var main = el('div', { 'class': 'view' });
    clear(document.getElementById('main')).appendChild(main);
    var view = { board: boardView, curves: curvesView, items: itemsView, compare: compareView,
                 about: aboutView, entry: entryView, item: itemPage }[r.view] || boardView;
    var hash = location.hash;
    document.body.removeAttribute('data-rendered');
    var done = function () {
      if (location.hash !== hash) return;
      document.body.setAttribute('data-rendered', hash || '#');
      document.body.setAttribute('data-ready', '1');        // the first view is drawn
    };
    var fail = function (e) { main.appendChild(el('p', { 'class': 'error', text: String(e.message || e) })); done(); };
    try {
      Promise.resolve(view(main, r)).then(done, fail);
    } catch (e) {
      fail(e);
    }
  }
