// pagedserve's chat UI: its name, logo and the server's status (model, connected or not) in
// the page's header, on every screen of the chat. The app sends the status through Chainlit's
// window messages ({pagedserve_status: {ok, headline, details}}) when a chat starts and after
// each answer; the header is React's, so the element is put back whenever React redraws it.
(function () {
  "use strict";
  let status = null;

  function render() {
    const header = document.getElementById("header");
    if (!header) return;
    let el = document.getElementById("pagedserve-status");
    if (!el) {
      el = document.createElement("div");
      el.id = "pagedserve-status";
      const logo = document.createElement("img");
      logo.src = "/favicon";
      logo.alt = "";
      const name = document.createElement("span");
      name.className = "ps-name";
      name.textContent = "pagedserve";
      const state = document.createElement("span");
      state.className = "ps-state";
      state.innerHTML = '<span class="ps-dot"></span><span class="ps-text">connecting…</span>';
      el.append(logo, name, state);
      (header.firstElementChild || header).appendChild(el);
    }
    if (!status) return;
    const text = el.querySelector(".ps-text");
    if (text.textContent !== status.headline) text.textContent = status.headline;
    const ok = status.ok ? "true" : "false";
    if (el.dataset.ok !== ok) el.dataset.ok = ok;
    if (el.title !== status.details) el.title = status.details;
  }

  window.addEventListener("message", (event) => {
    const data = event.source === window && event.data;
    if (data && typeof data === "object" && data.pagedserve_status) {
      status = data.pagedserve_status;
      render();
    }
  });
  // Only adds the element when it is missing and writes only what changed, so its own
  // changes do not wake the observer in a loop.
  new MutationObserver(render).observe(document.documentElement, {childList: true, subtree: true});
})();
