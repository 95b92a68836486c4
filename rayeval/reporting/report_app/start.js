  // --- start ---------------------------------------------------------------------------
  window.addEventListener('hashchange', render);
  Promise.all([get('meta'), get('board')]).then(function (got) {
    S.meta = got[0]; S.board = got[1];
    S.board.columns.forEach(function (c) { if (S.board.marked.indexOf(c.name) < 0 && c.marks && /^\.*$/.test(c.marks)) c.marks = null; });
    render();
  }).catch(function (e) {
    document.getElementById('main').appendChild(el('p', { 'class': 'error', text: 'The report could not load: ' + (e.message || e) }));
  });
