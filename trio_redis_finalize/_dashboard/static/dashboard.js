// trio_redis_finalize dashboard: the page refreshes its <main> in place
// (fetching the same URL with X-Partial: 1) every data-refresh seconds while
// the tab is visible; no framework, nothing loaded from elsewhere.
(function () {
  "use strict";
  var main = document.getElementById("live");
  if (!main || !main.dataset.refresh) { return; }
  var every = parseFloat(main.dataset.refresh) * 1000;
  function tick() {
    if (document.hidden) { return; }
    fetch(location.href, { headers: { "X-Partial": "1" }, credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (text) { if (text !== null) { main.innerHTML = text; main.dataset.updated = Date.now(); } })
      .catch(function () { /* the next tick tries again */ });
  }
  setInterval(tick, every);
})();
