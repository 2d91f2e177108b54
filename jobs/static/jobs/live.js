/*
 * Live refresh of the jobs console's pages: no build step, no dependencies.
 *
 * Elements marked data-jobs-live="<name>" are regions. Every few seconds the page fetches
 * its own URL (same path and query, so filters and pagination are kept) with the header
 * "X-Jobs-Live: 1", and each region's content is replaced by the same-named region of the
 * response; a region the response lacks is left alone. The operator's state survives:
 * checkboxes, radios and options they changed (by name and value), text typed into fields,
 * open <details>, focus and scroll positions. A refresh waits while a text field or a select
 * inside a region has focus or text is being selected there, and the page is left as it is
 * while a refresh would drop a row the operator has checked.
 *
 * The control (admin/jobs/live.html) pauses and resumes; the choice is kept in
 * localStorage. Refreshing also stops while the tab is hidden and runs at once on return.
 * A failed fetch backs off and says so; a response that is the login page stops refreshing.
 * Its state is on the control's data-jobs-live-state (on, paused, hidden, failed, expired)
 * and data-jobs-live-count (refreshes done), for people and tests alike.
 */
(function () {
  "use strict";

  const root = document.querySelector("[data-jobs-live-root]");
  if (!root || root.dataset.jobsLiveStarted) {
    return;
  }
  root.dataset.jobsLiveStarted = "1";

  const STORE = "jobs.live.paused";
  const MAX_DELAY = 60000;
  const label = root.querySelector(".jobs-live-state");
  const button = root.querySelector(".jobs-live-toggle");
  const status = root.querySelector(".jobs-live-status");
  const text = root.dataset;
  // Elements the admin's own scripts bound at load; the copies a refresh brings are ours.
  const original = new WeakSet(document.querySelectorAll("[data-jobs-live] input, [data-jobs-live] a, details"));

  let paused = readPaused();
  let expired = false;
  let leaving = false;
  let failures = 0;
  let timer = null;
  let inflight = null;
  let count = 0;
  let lastChecked = null;
  let shift = false;

  function readPaused() {
    try {
      return window.localStorage.getItem(STORE) === "1";
    } catch (error) {
      return false;
    }
  }

  function writePaused(value) {
    try {
      if (value) {
        window.localStorage.setItem(STORE, "1");
      } else {
        window.localStorage.removeItem(STORE);
      }
    } catch (error) {
      // Private windows may refuse storage; the choice then lasts for this page only.
    }
  }

  function interval() {
    const seconds = parseFloat(root.dataset.jobsLiveInterval);
    return (seconds > 0 ? seconds : 5) * 1000;
  }

  function clock() {
    return new Date().toTimeString().slice(0, 8);
  }

  function show(state, message) {
    root.dataset.jobsLiveState = state;
    const on = state !== "paused" && state !== "expired";
    label.textContent = on ? text.labelOn : text.labelOff;
    button.textContent = paused ? text.labelResume : text.labelPause;
    button.setAttribute("aria-pressed", paused ? "true" : "false");
    button.hidden = expired;
    if (message !== undefined) {
      status.textContent = message;
    }
  }

  function schedule(delay) {
    window.clearTimeout(timer);
    timer = null;
    if (paused || expired || leaving || document.hidden) {
      return;
    }
    timer = window.setTimeout(tick, delay);
  }

  function stop() {
    window.clearTimeout(timer);
    timer = null;
    if (inflight) {
      inflight.abort();
      inflight = null;
    }
  }

  // --- what the operator is doing -------------------------------------------------------

  function inRegion(node) {
    const element = node && (node.nodeType === 1 ? node : node.parentElement);
    return element ? element.closest("[data-jobs-live]") : null;
  }

  function typing() {
    const active = document.activeElement;
    if (active && inRegion(active)) {
      const tag = active.tagName;
      if (tag === "SELECT" || tag === "TEXTAREA" || active.isContentEditable) {
        return true;
      }
      if (tag === "INPUT" && !/^(checkbox|radio|button|submit|reset|hidden|image)$/i.test(active.type)) {
        return true;
      }
    }
    const selection = window.getSelection ? window.getSelection() : null;
    return Boolean(selection && !selection.isCollapsed && inRegion(selection.anchorNode));
  }

  // A key naming a form field the same way in the page and in a response.
  function fieldKey(el) {
    const name = el.name || el.id || "";
    if (el.type === "checkbox" || el.type === "radio") {
      return el.type + ":" + name + "=" + el.value;
    }
    return el.tagName + ":" + name;
  }

  function keyed(region, selector, keyOf) {
    const found = new Map();
    region.querySelectorAll(selector).forEach(function (el) {
      const key = keyOf(el);
      let n = 0;
      while (found.has(key + "#" + n)) {
        n += 1;
      }
      found.set(key + "#" + n, el);
    });
    return found;
  }

  function detailsKey(el) {
    return el.dataset.filterTitle || el.id || "details";
  }

  function scrollKey(el) {
    return el.id || el.className || el.tagName;
  }

  function capture(region) {
    const state = { fields: [], details: [], scrolls: [], across: false, focus: null };
    keyed(region, "input, select, textarea", fieldKey).forEach(function (el, key) {
      if (el.type === "checkbox" || el.type === "radio") {
        if (el.checked !== el.defaultChecked) {
          state.fields.push({ key: key, checked: el.checked });
        }
      } else if (el.tagName === "SELECT") {
        const changed = Array.from(el.options).some(function (o) {
          return o.selected !== o.defaultSelected;
        });
        if (changed) {
          const values = Array.from(el.selectedOptions).map(function (o) {
            return o.value;
          });
          state.fields.push({ key: key, values: values });
        }
      } else if (el.type !== "hidden" && el.type !== "submit" && el.value !== el.defaultValue) {
        state.fields.push({ key: key, value: el.value });
      }
      if (el === document.activeElement) {
        state.focus = key;
      }
    });
    keyed(region, "details", detailsKey).forEach(function (el, key) {
      state.details.push({ key: key, open: el.open });
    });
    keyed(region, "div, table, pre, ul, search", scrollKey).forEach(function (el, key) {
      if (el.scrollTop || el.scrollLeft) {
        state.scrolls.push({ key: key, top: el.scrollTop, left: el.scrollLeft });
      }
    });
    region.querySelectorAll("input.select-across").forEach(function (el) {
      state.across = state.across || el.value === "1";
    });
    return state;
  }

  // Would replacing the region with ``fresh`` drop a row the operator checked?
  function loses(state, fresh) {
    const there = keyed(fresh, "input, select, textarea", fieldKey);
    return state.fields.some(function (field) {
      return field.checked === true && !there.has(field.key);
    });
  }

  function restore(region, state) {
    const fields = keyed(region, "input, select, textarea", fieldKey);
    state.fields.forEach(function (field) {
      const el = fields.get(field.key);
      if (!el) {
        return;
      }
      if (field.checked !== undefined) {
        el.checked = field.checked;
      } else if (field.values !== undefined) {
        Array.from(el.options).forEach(function (o) {
          o.selected = field.values.indexOf(o.value) !== -1;
        });
      } else {
        el.value = field.value;
      }
    });
    const details = keyed(region, "details", detailsKey);
    state.details.forEach(function (item) {
      const el = details.get(item.key);
      if (el) {
        el.open = item.open;
      }
    });
    const scrolls = keyed(region, "div, table, pre, ul, search", scrollKey);
    state.scrolls.forEach(function (item) {
      const el = scrolls.get(item.key);
      if (el) {
        el.scrollTop = item.top;
        el.scrollLeft = item.left;
      }
    });
    if (state.across) {
      region.querySelectorAll("input.select-across").forEach(function (el) {
        el.value = "1";
      });
      region.querySelectorAll("input.action-select").forEach(function (el) {
        el.checked = true;
      });
    }
    if (state.focus && fields.get(state.focus)) {
      fields.get(state.focus).focus({ preventScroll: true });
    }
  }

  // --- the admin changelist's selection, once a refresh has replaced its table -----------
  // Django's actions.js binds to the elements present at load; for the copies a refresh
  // brings, these handlers do the same from the page as it is now.

  function form() {
    return document.getElementById("changelist-form");
  }

  function boxes() {
    const list = form();
    return list ? Array.from(list.querySelectorAll("tr input.action-select")) : [];
  }

  function toggleHidden(selector, hidden) {
    document.querySelectorAll(selector).forEach(function (el) {
      el.classList.toggle("hidden", hidden);
    });
  }

  function syncSelection() {
    const all = boxes();
    if (!all.length) {
      return;
    }
    const selected = all.filter(function (el) {
      return el.checked;
    });
    all.forEach(function (el) {
      const row = el.closest("tr");
      if (row) {
        row.classList.toggle("selected", el.checked);
      }
    });
    const counter = document.querySelector("div.actions span.action-counter");
    if (counter) {
      const total = Number(counter.dataset.actionsIcnt);
      const template = window.ngettext
        ? window.ngettext("%(sel)s of %(cnt)s selected", "%(sel)s of %(cnt)s selected", selected.length)
        : "%(sel)s of %(cnt)s selected";
      counter.textContent = window.interpolate
        ? window.interpolate(template, { sel: selected.length, cnt: total }, true)
        : template.replace("%(sel)s", selected.length).replace("%(cnt)s", total);
    }
    const toggle = document.getElementById("action-toggle");
    const everything = selected.length === all.length;
    if (toggle) {
      toggle.checked = everything;
    }
    const across = document.querySelector("div.actions input.select-across");
    const acrossOn = Boolean(across && across.value === "1" && everything);
    const actions = document.querySelector("div.actions");
    if (actions) {
      actions.classList.toggle("selected", selected.length > 0);
    }
    toggleHidden("div.actions span.question", !everything || acrossOn);
    toggleHidden("div.actions span.clear", !acrossOn);
    toggleHidden("div.actions span.all", !acrossOn);
    toggleHidden("div.actions span.action-counter", acrossOn);
    if (!everything) {
      document.querySelectorAll("div.actions input.select-across").forEach(function (el) {
        el.value = "0";
      });
    }
  }

  function setAcross(on) {
    document.querySelectorAll("div.actions input.select-across").forEach(function (el) {
      el.value = on ? "1" : "0";
    });
  }

  document.addEventListener("change", function (event) {
    const el = event.target;
    if (original.has(el) || !inRegion(el)) {
      return;
    }
    if (el.matches("tr input.action-select")) {
      const all = boxes();
      if (shift && lastChecked && lastChecked !== el && all.indexOf(lastChecked) !== -1) {
        const from = all.indexOf(lastChecked);
        const to = all.indexOf(el);
        all.slice(Math.min(from, to), Math.max(from, to) + 1).forEach(function (box) {
          box.checked = el.checked;
        });
      }
      lastChecked = el;
      syncSelection();
    }
  });

  document.addEventListener("click", function (event) {
    const el = event.target;
    if (!(el instanceof Element) || original.has(el) || !inRegion(el)) {
      return;
    }
    if (el.id === "action-toggle") {
      boxes().forEach(function (box) {
        box.checked = el.checked;
      });
      setAcross(false);
      syncSelection();
    } else if (el.closest("div.actions span.question a")) {
      event.preventDefault();
      setAcross(true);
      syncSelection();
    } else if (el.closest("div.actions span.clear a")) {
      event.preventDefault();
      setAcross(false);
      boxes().forEach(function (box) {
        box.checked = false;
      });
      syncSelection();
    }
  });

  // Shift-click selects a range, as in the admin; a change event does not say if shift was held.
  document.addEventListener("keydown", function (event) {
    shift = event.shiftKey;
  });
  document.addEventListener("keyup", function (event) {
    shift = event.shiftKey;
  });

  // The admin keeps which filters are open in sessionStorage; keep doing so for new copies.
  document.addEventListener(
    "toggle",
    function (event) {
      const el = event.target;
      if (!(el instanceof HTMLDetailsElement) || original.has(el) || !el.dataset.filterTitle) {
        return;
      }
      try {
        const saved = JSON.parse(window.sessionStorage.getItem("django.admin.filtersState")) || {};
        saved[el.dataset.filterTitle] = el.open;
        window.sessionStorage.setItem("django.admin.filtersState", JSON.stringify(saved));
      } catch (error) {
        // Storage refused: the filter stays as it is on this page.
      }
    },
    true
  );

  // --- refreshing -----------------------------------------------------------------------

  function isLogin(response, doc) {
    if (doc.getElementById("login-form")) {
      return true;
    }
    const login = text.jobsLiveLogin;
    return Boolean(login && response.redirected && new URL(response.url).pathname === login);
  }

  // Replace every region the response has; if that would drop a row the operator checked,
  // replace none, so that the page never shows counts that disagree with its table.
  function swap(doc) {
    const x = window.scrollX;
    const y = window.scrollY;
    const pairs = [];
    document.querySelectorAll("[data-jobs-live]").forEach(function (region) {
      const name = region.dataset.jobsLive;
      const fresh = doc.querySelector('[data-jobs-live="' + CSS.escape(name) + '"]');
      if (fresh) {
        pairs.push({ region: region, fresh: fresh, state: capture(region) });
      }
    });
    const held = pairs.some(function (pair) {
      return loses(pair.state, pair.fresh);
    });
    if (held) {
      return { found: pairs.length, held: true };
    }
    pairs.forEach(function (pair) {
      pair.region.replaceChildren.apply(
        pair.region,
        Array.from(pair.fresh.childNodes).map(function (node) {
          return document.importNode(node, true);
        })
      );
      restore(pair.region, pair.state);
    });
    syncSelection();
    window.scrollTo(x, y);
    return { found: pairs.length, held: false };
  }

  function failed() {
    failures += 1;
    show("failed", text.labelFailed);
    schedule(Math.min(interval() * Math.pow(2, failures), MAX_DELAY));
  }

  function tick() {
    timer = null;
    if (paused || expired || leaving || document.hidden) {
      return;
    }
    if (typing()) {
      schedule(interval());
      return;
    }
    refresh();
  }

  function refresh() {
    stop();
    const controller = new AbortController();
    inflight = controller;
    fetch(window.location.pathname + window.location.search, {
      headers: { "X-Jobs-Live": "1", Accept: "text/html" },
      credentials: "same-origin",
      cache: "no-store",
      signal: controller.signal,
    })
      .then(function (response) {
        return response.text().then(function (body) {
          return { response: response, body: body };
        });
      })
      .then(function (result) {
        if (inflight !== controller) {
          return;
        }
        inflight = null;
        const doc = new DOMParser().parseFromString(result.body, "text/html");
        if (isLogin(result.response, doc)) {
          expired = true;
          stop();
          show("expired", text.labelExpired);
          return;
        }
        if (!result.response.ok) {
          failed();
          return;
        }
        if (paused || leaving) {
          return;
        }
        if (typing()) {
          schedule(interval());
          return;
        }
        const done = swap(doc);
        if (!done.found) {
          failed();
          return;
        }
        failures = 0;
        count += 1;
        root.dataset.jobsLiveCount = String(count);
        if (done.held) {
          show("on", text.labelHeld);
        } else {
          show("on", text.labelUpdated.replace("%(time)s", clock()));
        }
        schedule(interval());
      })
      .catch(function (error) {
        if (inflight !== controller) {
          return;
        }
        inflight = null;
        if (error && error.name === "AbortError") {
          return;
        }
        failed();
      });
  }

  button.addEventListener("click", function () {
    paused = !paused;
    writePaused(paused);
    if (paused) {
      stop();
      show("paused", text.labelPaused);
    } else {
      failures = 0;
      show("on");
      refresh();
    }
  });

  document.addEventListener("visibilitychange", function () {
    if (paused || expired || leaving) {
      return;
    }
    if (document.hidden) {
      stop();
      show("hidden");
    } else {
      show("on");
      refresh();
    }
  });

  // A form being sent (an action, a search) or the page being left: no swap under it.
  document.addEventListener("submit", function (event) {
    if (!event.defaultPrevented) {
      leaving = true;
      stop();
    }
  });
  window.addEventListener("pagehide", function () {
    leaving = true;
    stop();
  });
  window.addEventListener("pageshow", function (event) {
    if (event.persisted) {
      leaving = false;
      if (!paused && !expired) {
        refresh();
      }
    }
  });

  root.hidden = false;
  root.dataset.jobsLiveCount = "0";
  if (paused) {
    show("paused", text.labelPaused);
  } else {
    show("on", text.labelUpdated.replace("%(time)s", clock()));
    schedule(interval());
  }
})();
