// The web chat page's markdown (orchestrator/gateway/chat_page.py inlines the bundle `npm run chat-markdown` builds
// from this into orchestrator/gateway/chat_markdown.js; tests/test_chat_page.py fails when the two drift).
// marked renders GitHub-flavoured markdown (fenced code, tables, lists); it does not sanitise, by design, so
// DOMPurify (an allow-list sanitiser, the one marked's documentation names) takes every element and attribute it
// does not know to be inert out of what marked rendered, and hands back a DocumentFragment: the page never assigns
// innerHTML. Raw HTML in an answer is shown as the text the model wrote (a model explaining `<div>` outside a code
// span shows `<div>`), and an image as a link to it (the page's CSP loads nothing from another origin anyway).
import DOMPurify from "dompurify";
import { Marked } from "marked";

const escape = (s) => s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
const marked = new Marked({
  gfm: true,
  renderer: {
    html: ({ text }) => escape(text),
    image: ({ href, text }) => `<a href="${escape(href || "")}">${escape(text || href || "")}</a>`,
  },
});
const purify = DOMPurify(window);
purify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {  // links open elsewhere, telling the other site nothing
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

globalThis.tandemMarkdown = {
  /** ``text`` (markdown) as sanitised DOM nodes. */
  render: (text) => purify.sanitize(marked.parse(text, { async: false }),
                                    { RETURN_DOM_FRAGMENT: true, FORBID_TAGS: ["style", "form", "img"] }),
  versions: { dompurify: purify.version },
};
