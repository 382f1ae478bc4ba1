--
-- PostgreSQL database dump
--

\restrict Am15nNuZlWuSJ8gGBKhdSBkrq1rF8dIUCBP7ZWj5ZL35O2dzqeJGoH2slG8RPeQ

-- Dumped from database version 15.18 (Debian 15.18-0+deb12u1)
-- Dumped by pg_dump version 15.18 (Debian 15.18-0+deb12u1)

SET statement_timeout = 0;
SET lock_timeout = 0;
SET idle_in_transaction_session_timeout = 0;
SET client_encoding = 'UTF8';
SET standard_conforming_strings = on;
SELECT pg_catalog.set_config('search_path', '', false);
SET check_function_bodies = false;
SET xmloption = content;
SET client_min_messages = warning;
SET row_security = off;

SET default_tablespace = '';

SET default_table_access_method = heap;

--
-- Name: bridge_meta; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.bridge_meta (
    key character varying(64) NOT NULL,
    value text NOT NULL
);


--
-- Name: poller_lease; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.poller_lease (
    name text NOT NULL,
    holder text,
    epoch bigint DEFAULT 0 NOT NULL,
    acquired_at timestamp with time zone,
    renewed_at timestamp with time zone,
    expires_at timestamp with time zone DEFAULT '-infinity'::timestamp with time zone NOT NULL
);


--
-- Name: task_tags; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.task_tags (
    task_seq integer NOT NULL,
    key text NOT NULL,
    value text NOT NULL
);


--
-- Name: tasks; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.tasks (
    seq integer NOT NULL,
    id character varying(64) NOT NULL,
    state character varying(16) NOT NULL,
    name text,
    owner character varying(255),
    creation_time character varying(40) NOT NULL,
    document text NOT NULL,
    logs text NOT NULL,
    job_id character varying(64),
    attempt integer NOT NULL,
    submit_started_at real,
    next_submit_at real,
    cancel_pending boolean NOT NULL,
    cleaned boolean NOT NULL,
    updated_at real NOT NULL
);


--
-- Name: tasks_seq_seq; Type: SEQUENCE; Schema: public; Owner: -
--

CREATE SEQUENCE public.tasks_seq_seq
    AS integer
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;


--
-- Name: tasks_seq_seq; Type: SEQUENCE OWNED BY; Schema: public; Owner: -
--

ALTER SEQUENCE public.tasks_seq_seq OWNED BY public.tasks.seq;


--
-- Name: tasks seq; Type: DEFAULT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.tasks ALTER COLUMN seq SET DEFAULT nextval('public.tasks_seq_seq'::regclass);


--
-- Data for Name: bridge_meta; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.bridge_meta VALUES ('schema_version', '1');
INSERT INTO public.bridge_meta VALUES ('created_at', '2026-11-29T02:22:06.979506Z');
INSERT INTO public.bridge_meta VALUES ('page_token_secret', 'e31a8a0526ae65153f9e19649043c5a5996c3280d4e583f1a3519444fbd71650');
INSERT INTO public.bridge_meta VALUES ('version', '0.1.0');
INSERT INTO public.bridge_meta VALUES ('updated_at', '2026-11-29T02:22:06.979506Z');


--
-- Data for Name: poller_lease; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.poller_lease VALUES ('poller', NULL, 0, NULL, NULL, '-infinity');


--
-- Data for Name: task_tags; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.task_tags VALUES (1, 'run', 'nf-1');
INSERT INTO public.task_tags VALUES (1, 'sample', '1');
INSERT INTO public.task_tags VALUES (2, 'run', 'nf-1');
INSERT INTO public.task_tags VALUES (2, 'sample', '2');


--
-- Data for Name: tasks; Type: TABLE DATA; Schema: public; Owner: -
--

INSERT INTO public.tasks VALUES (2, '98fda823-0963-49ae-8171-00912cee9771', 'QUEUED', 'align sample-2', 'alice', '2026-11-29T02:22:06.995386Z', '{"name":"align sample-2","tags":{"run":"nf-1","sample":"2"},"executors":[{"image":"alpine","command":["echo","two"]}]}', '[]', NULL, 0, NULL, NULL, false, false, 1.795919e+09);
INSERT INTO public.tasks VALUES (1, '2092a18c-a5c4-4980-96b7-2b91df2cac9e', 'COMPLETE', 'align sample-1', 'alice', '2026-11-29T02:22:06.991797Z', '{"name":"align sample-1","tags":{"run":"nf-1","sample":"1"},"executors":[{"image":"alpine","command":["echo","one"]}]}', '[{"logs": [{"stdout": "one\n", "exit_code": 0}], "system_logs": ["job 7"]}]', '7', 1, NULL, NULL, false, false, 1.795919e+09);
INSERT INTO public.tasks VALUES (3, '1f8eaec4-5a72-4f51-83d3-0ab656b45b7c', 'CANCELED', NULL, 'alice', '2026-11-29T02:22:06.998353Z', '{"executors":[{"image":"alpine","command":["sleep","60"]}]}', '[]', NULL, 0, NULL, NULL, false, false, 1.795919e+09);


--
-- Name: tasks_seq_seq; Type: SEQUENCE SET; Schema: public; Owner: -
--

SELECT pg_catalog.setval('public.tasks_seq_seq', 3, true);


--
-- Name: bridge_meta bridge_meta_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.bridge_meta
    ADD CONSTRAINT bridge_meta_pkey PRIMARY KEY (key);


--
-- Name: poller_lease poller_lease_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.poller_lease
    ADD CONSTRAINT poller_lease_pkey PRIMARY KEY (name);


--
-- Name: task_tags task_tags_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.task_tags
    ADD CONSTRAINT task_tags_pkey PRIMARY KEY (task_seq, key);


--
-- Name: tasks tasks_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.tasks
    ADD CONSTRAINT tasks_pkey PRIMARY KEY (seq);


--
-- Name: task_tags_key_value_task_seq; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX task_tags_key_value_task_seq ON public.task_tags USING btree (key, value, task_seq);


--
-- Name: task_tags_task_seq; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX task_tags_task_seq ON public.task_tags USING btree (task_seq);


--
-- Name: tasks_cancel_pending; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_cancel_pending ON public.tasks USING btree (cancel_pending);


--
-- Name: tasks_id; Type: INDEX; Schema: public; Owner: -
--

CREATE UNIQUE INDEX tasks_id ON public.tasks USING btree (id);


--
-- Name: tasks_job_id; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_job_id ON public.tasks USING btree (job_id);


--
-- Name: tasks_name; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_name ON public.tasks USING btree (name);


--
-- Name: tasks_name_c; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_name_c ON public.tasks USING btree (name COLLATE "C", seq);


--
-- Name: tasks_owner_seq; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_owner_seq ON public.tasks USING btree (owner, seq);


--
-- Name: tasks_state_seq; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX tasks_state_seq ON public.tasks USING btree (state, seq);


--
-- Name: task_tags task_tags_task_seq_fkey; Type: FK CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.task_tags
    ADD CONSTRAINT task_tags_task_seq_fkey FOREIGN KEY (task_seq) REFERENCES public.tasks(seq) ON DELETE CASCADE;


--
-- PostgreSQL database dump complete
--

\unrestrict Am15nNuZlWuSJ8gGBKhdSBkrq1rF8dIUCBP7ZWj5ZL35O2dzqeJGoH2slG8RPeQ

