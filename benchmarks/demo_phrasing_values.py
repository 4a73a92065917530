"""Record values and framing words for the phrasing generator (demo_phrasing.py): names from ~45
languages in Latin script (particles, hyphens, apostrophes, initials), ~540 cities, generated
companies (legal forms, hospitals, schools, shops), roles, products (brand + model code + noun),
colors, and made-up words (MADE_UP of string values) so that the model learns to copy spans rather
than recall them. Lists hold no digits; an "_" joins the words of one list item."""

import random
import re

from tpu_models.benchmarks.demo_data import made_up_word

MADE_UP = 0.3  # share of string values that are made-up words
FIELDS = {"person": ("name", "age", "city"), "product": ("product", "color", "price"),
          "employee": ("name", "role", "company", "years")}
RANGES = {"age": (18, 90), "price": (5, 9999), "years": (1, 40)}


def _items(text):
    return [item.replace("_", " ") for item in text.split()]


# "language: first names | surnames": tens of thousands of combinations.
NAMES = {lang: (_items(firsts), _items(lasts))
         for lang, firsts, lasts in (re.split(r"\s*[:|]\s*", line) for line in """
es: José María Lucía Alejandro Sofía Carmen Javier Valentina Diego Camila Ximena Rodrigo Andrés Paola | García Rodríguez \
López Pérez Torres Ramírez Fernández Martínez Herrera Castillo de_la_Cruz del_Río
pt: João Ana Luís Beatriz Tiago Mariana Gonçalo Inês Larissa Thiago Rafaela Conceição | Silva Santos Oliveira Souza Costa \
Ferreira Rocha Carvalho Almeida dos_Santos da_Silva Gonçalves
it: Giulia Alessandro Francesca Matteo Chiara Lorenzo Giorgio Federica Niccolò | Rossi Russo Ferrari Esposito Bianchi \
Romano Colombo De_Luca Ricci Marino D'Angelo
fr: Élodie Chloé Théo Mathis Léa Hélène François Amélie Gaël Jean-Pierre Marie-Claire Benoît | Dubois Lefèvre Moreau \
Laurent Girard Rousseau Fontaine Mercier de_Villiers Le_Goff
de: Lukas Anna Jonas Lena Felix Hannah Jürgen Sabine Matthias Jörg Friederike Günther | Müller Schmidt Fischer Weber \
Becker Köhler Schäfer Hoffmann von_Arnim Zimmermann
nl: Daan Sanne Bram Femke Joris Lieke Maarten Anouk Sjoerd | de_Vries van_Dijk Jansen Bakker Visser Smit van_der_Berg \
de_Jong van_den_Broek
pl: Łukasz Katarzyna Piotr Agnieszka Tomasz Małgorzata Zofia Wojciech Grzegorz | Kowalski Nowak Wiśniewska Wójcik \
Dąbrowski Lewandowski Zieliński
cs: Jiří Tereza Ondřej Petra Vojtěch Zuzana Lukáš | Novák Svobodová Dvořák Černý Procházka Kučerová
hu: Bence Zsófia Levente Réka Gergő Dóra | Nagy Kovács Tóth Szabó Horváth Varga
ro: Andrei Ioana Mihai Elena Bogdan Alexandra Cristian | Popescu Ionescu Dumitrescu Stan Munteanu Constantinescu
el: Giorgos Eleni Dimitris Katerina Nikos Yannis Despina | Papadopoulos Georgiou Nikolaidis Konstantinou Papadakis \
Oikonomou
ru: Dmitri Olga Sergei Natalia Alexei Yekaterina Ivan Anastasia | Ivanov Petrova Smirnov Kuznetsova Volkov Sokolov \
Morozova
uk: Oleksandr Oksana Bohdan Iryna Taras Yulia | Shevchenko Bondarenko Kovalenko Tkachenko Kravchenko Melnyk
tr: Emre Elif Mehmet Zeynep Burak Ayşe Selin Çağrı Şeyma Oğuz Merve | Yılmaz Kaya Demir Şahin Çelik Öztürk Aydın Arslan
ar: Ahmed Fatima Omar Layla Yusuf Amira Khalid Noor Hassan Zainab Mahmoud Rania | Al-Sayed Haddad Mansour Khalil Nasser \
El-Amin Aziz bin_Rashid Al_Farsi Abdel_Rahman
fa: Dariush Shirin Reza Parisa Kian Niloufar Arash | Hosseini Rahimi Karimi Tehrani Moradi Jafari
he: Noa Yael Itai Tamar Eitan Shira Avi | Cohen Levi Mizrahi Peretz Biton Friedman
hi: Aarav Diya Rohan Ananya Vikram Sneha Arjun Kavya Rahul Deepika Ishaan | Sharma Patel Gupta Singh Reddy Iyer Nair Mehta \
Chatterjee Banerjee
ta: Karthik Lakshmi Senthil Meenakshi Arun Divya Murugan | Subramanian Krishnan Ramasamy Venkatesan Pillai
bn: Arif Nusrat Tanvir Farhana Rafiq Sadia | Rahman Hossain Chowdhury Islam Uddin Akter
ur: Usman Ayesha Bilal Hira Faisal Sana Zain | Qureshi Malik Siddiqui Butt Chaudhry Raza
id: Budi Siti Agus Dewi Wahyu Putri Rizky Ayu | Santoso Wijaya Hidayat Kusuma Saputra Nugroho Setiawan
ms: Ahmad Nurul Hafiz Aisyah Farid Syafiq | bin_Ismail binti_Yusof bin_Abdullah Rahim Hashim
th: Somchai Nattaya Anan Kanya Chaiwat Siriporn | Srisuk Wongsawat Chaiyaporn Rattanakorn Suwannarat
fil: Jericho Maricel Rommel Jasmine Paolo Kristine | dela_Cruz Reyes Bautista Villanueva Mendoza Aquino
vi: Linh Minh Thảo Hương Đức Quang Trang Bảo Tuấn Phương | Nguyễn Nguyen Tran Trần Pham Hoang Vu Dang Bui Lê
zh: Wei Fang Jing Lei Xiaoming Mei Hao Yan Jun Xiu Zhen Zihan Yichen | Wang Zhang Liu Chen Yang Huang Zhao Zhou Xu Lin
ko: Ji-woo Min-jun Seo-yeon Do-hyun Hye-jin Jae-won Soo-ah Eun-ji Hyun-woo | Kim Lee Park Choi Jung Kang Yoon Han
ja: Haruto Yui Sota Aoi Hina Takumi Sakura Kenji Yuki Daichi Ren | Sato Suzuki Takahashi Tanaka Yamamoto Nakamura \
Kobayashi Watanabe
mn: Bat-Erdene Oyuntsetseg Temuulen Enkhjin Bolormaa | Batbayar Ganbaatar Dorj Enkhbold
ng: Adebayo Chiamaka Oluwaseun Ngozi Emeka Funmilayo Chinedu Yetunde Obinna Aisha Musa | Okafor Adeyemi Okonkwo Balogun \
Eze Nwosu Bello Abubakar
gh: Kwame Ama Kofi Akosua Yaw Abena Kwabena | Mensah Owusu Asante Boateng Appiah Osei
et: Abebe Tigist Dawit Selam Yonas Hiwot | Bekele Tesfaye Haile Girma Alemu Tadesse
sw: Amani Baraka Zawadi Juma Neema Imani Jabari Rehema Wanjiru Achieng | Mwangi Otieno Kamau Njoroge Mutua Kimani Wambui
za: Thandiwe Sipho Lerato Thabo Nomvula Bongani | Dlamini Nkosi Mahlangu Ndlovu van_der_Merwe Botha
so: Abdi Hodan Farah Amina Liban | Warsame Abdullahi Hirsi Jama
en: Tom Sarah James Emily Michael Olivia Daniel Grace Ethan Chloe Zoë Megan Liam | Smith Johnson Taylor Wilson Clark \
Hughes McAllister Fitzgerald O'Neill Baker-Jones
gd: Callum Eilidh Fraser Isla Hamish Morag | MacLeod MacDonald McKenzie Campbell Stewart
ga: Aoife Siobhán Niamh Cian Oisín Saoirse Ciarán Róisín Eoin | O'Brien Murphy Kelly O'Sullivan Byrne Walsh Doyle \
Ó_Súilleabháin
no: Sven Astrid Magnus Ingrid Lars Sigrid Björn Freja Søren Åsa | Johansson Andersson Lindqvist Nilsen Hansen Jørgensen \
Bergström
is: Guðrún Sigurður Katrín Jón Helga | Jónsdóttir Sigurðsson Guðmundsdóttir Einarsson
fi: Aino Eero Onni Helmi Väinö Sanna Juha Kaisa Mikko Ilona | Virtanen Korhonen Mäkinen Nieminen Hämäläinen Järvinen
eu: Iñaki Aitor Nerea Amaia Unai | Etxeberria Goikoetxea Agirre Urrutia
mi: Aroha Tama Mere Wiremu Hemi Sione Mele Losa | Ngata Parata Tipene Fifita Taufa
""".strip().splitlines())}
SURNAME_FIRST = {"vi", "ko", "ja", "zh", "hu"}  # sometimes: "Park Jae-won", "Nagy Réka"

CITIES = [c.strip() for c in """Lagos|Ibadan|Kano|Abuja|Port Harcourt|Enugu|Accra|Kumasi|Tamale|Nairobi|Mombasa|Kisumu|
Eldoret|Kampala|Gulu|Kigali|Dar es Salaam|Arusha|Dodoma|Addis Ababa|Bahir Dar|Mekelle|Khartoum|Cairo|Alexandria|Luxor|
Casablanca|Marrakesh|Fès|Rabat|Tangier|Tunis|Sfax|Algiers|Oran|Dakar|Saint-Louis|Bamako|Ouagadougou|Niamey|Abidjan|Lomé|
Cotonou|Porto-Novo|Freetown|Monrovia|Conakry|Douala|Yaoundé|Libreville|Brazzaville|Kinshasa|Lubumbashi|Luanda|Lusaka|Ndola|
Harare|Bulawayo|Maputo|Lilongwe|Blantyre|Gaborone|Windhoek|Johannesburg|Cape Town|Durban|Pretoria|Gqeberha|Bloemfontein|
Maseru|Antananarivo|Port Louis|Mogadishu|Hargeisa|Asmara|Juba|Istanbul|Ankara|İzmir|Bursa|Antalya|Gaziantep|Tehran|Isfahan|
Shiraz|Tabriz|Mashhad|Baghdad|Erbil|Basra|Riyadh|Jeddah|Dammam|Dubai|Abu Dhabi|Sharjah|Doha|Manama|Muscat|Kuwait City|Amman|
Irbid|Beirut|Damascus|Aleppo|Jerusalem|Tel Aviv|Haifa|Ramallah|Sana'a|Mumbai|Pune|New Delhi|Bangalore|Bengaluru|Chennai|
Hyderabad|Kolkata|Ahmedabad|Jaipur|Lucknow|Kochi|Thiruvananthapuram|Coimbatore|Chandigarh|Indore|Bhopal|Patna|Guwahati|
Karachi|Lahore|Islamabad|Peshawar|Faisalabad|Dhaka|Chittagong|Sylhet|Kathmandu|Pokhara|Colombo|Kandy|Thimphu|Malé|Kabul|
Herat|Tokyo|Osaka|Kyoto|Sapporo|Fukuoka|Nagoya|Yokohama|Sendai|Hiroshima|Seoul|Busan|Incheon|Daegu|Gwangju|Beijing|Shanghai|
Shenzhen|Guangzhou|Chengdu|Chongqing|Wuhan|Xi'an|Hangzhou|Nanjing|Suzhou|Harbin|Kunming|Xiamen|Hong Kong|Macau|Taipei|
Kaohsiung|Taichung|Ulaanbaatar|Hanoi|Ho Chi Minh City|Da Nang|Huế|Hải Phòng|Cần Thơ|Phnom Penh|Siem Reap|Vientiane|
Luang Prabang|Bangkok|Chiang Mai|Phuket|Khon Kaen|Yangon|Mandalay|Kuala Lumpur|George Town|Johor Bahru|Kota Kinabalu|
Kuching|Singapore|Jakarta|Surabaya|Bandung|Medan|Yogyakarta|Denpasar|Makassar|Manila|Quezon City|Cebu City|Davao City|
Iloilo City|Bandar Seri Begawan|Dili|Almaty|Astana|Tashkent|Samarkand|Bishkek|Dushanbe|Baku|Tbilisi|Batumi|Yerevan|Paris|
Lyon|Marseille|Toulouse|Nice|Nantes|Strasbourg|Bordeaux|Lille|Besançon|Aix-en-Provence|Berlin|Munich|Hamburg|Cologne|
Düsseldorf|Stuttgart|Leipzig|Dresden|Nuremberg|Bremen|Frankfurt am Main|Freiburg im Breisgau|Vienna|Graz|Salzburg|Innsbruck|
Zürich|Geneva|Basel|Bern|Lausanne|Amsterdam|Rotterdam|Utrecht|The Hague|Eindhoven|Groningen|Brussels|Antwerp|Ghent|Liège|
Luxembourg|Copenhagen|Aarhus|Odense|Oslo|Bergen|Trondheim|Tromsø|Stockholm|Gothenburg|Malmö|Uppsala|Helsinki|Tampere|Turku|
Oulu|Reykjavík|Akureyri|Tallinn|Tartu|Riga|Vilnius|Kaunas|Warsaw|Kraków|Łódź|Wrocław|Gdańsk|Poznań|Prague|Brno|Ostrava|
Bratislava|Košice|Budapest|Debrecen|Szeged|Ljubljana|Zagreb|Split|Dubrovnik|Belgrade|Novi Sad|Sarajevo|Mostar|Podgorica|
Skopje|Tirana|Plovdiv|Varna|Bucharest|Cluj-Napoca|Timișoara|Iași|Chișinău|Kyiv|Lviv|Odesa|Kharkiv|Minsk|Athens|Thessaloniki|
Heraklion|Patras|Nicosia|Limassol|Valletta|Rome|Milan|Naples|Turin|Florence|Bologna|Venice|Palermo|Genoa|Bari|Madrid|
Barcelona|Valencia|Seville|Málaga|Bilbao|Zaragoza|Granada|Palma de Mallorca|Santa Cruz de Tenerife|San Sebastián|Lisbon|
Porto|Coimbra|Braga|Faro|Funchal|Dublin|Cork|Galway|Limerick|Belfast|Derry|London|Manchester|Birmingham|Liverpool|Leeds|
Bristol|Newcastle upon Tyne|Sheffield|Nottingham|Brighton|Oxford|Cambridge|Cardiff|Swansea|Edinburgh|Glasgow|Aberdeen|
Dundee|Inverness|Saint Petersburg|Moscow|Kazan|Novosibirsk|Yekaterinburg|Vladivostok|New York City|Brooklyn|Boston|
Philadelphia|Baltimore|Pittsburgh|Atlanta|Miami|Orlando|Tampa|Charlotte|Raleigh|Nashville|Memphis|New Orleans|Houston|
Dallas|Austin|San Antonio|El Paso|Denver|Phoenix|Tucson|Albuquerque|Las Vegas|Salt Lake City|Boise|Seattle|Portland|
San Francisco|Oakland|San Jose|Los Angeles|San Diego|Sacramento|Fresno|Chicago|Detroit|Minneapolis|Milwaukee|Cleveland|
Columbus|Indianapolis|St. Louis|Kansas City|Omaha|Anchorage|Honolulu|Toronto|Montréal|Ottawa|Québec City|Vancouver|Victoria|
Calgary|Edmonton|Winnipeg|Halifax|St. John's|Saskatoon|Mexico City|Guadalajara|Monterrey|Puebla|Oaxaca|Mérida|Tijuana|
Cancún|Guatemala City|San Salvador|Tegucigalpa|Managua|San José|Panama City|Havana|Santiago de Cuba|Santo Domingo|San Juan|
Port-au-Prince|Kingston|Port of Spain|Bridgetown|Nassau|Bogotá|Medellín|Cali|Cartagena|Barranquilla|Caracas|Maracaibo|Quito|
Guayaquil|Cuenca|Lima|Arequipa|Cusco|Trujillo|La Paz|Cochabamba|Sucre|Santiago|Valparaíso|Concepción|Buenos Aires|Córdoba|
Rosario|Mendoza|Montevideo|Asunción|São Paulo|Rio de Janeiro|Belo Horizonte|Brasília|Salvador|Recife|Fortaleza|Manaus|Belém|
Curitiba|Porto Alegre|Florianópolis|Paramaribo|Georgetown|Sydney|Melbourne|Brisbane|Perth|Adelaide|Hobart|Darwin|Canberra|
Gold Coast|Cairns|Auckland|Wellington|Christchurch|Dunedin|Hamilton|Queenstown|Suva|Nadi|Apia|Nuku'alofa|Port Vila|
Port Moresby|Nouméa|Papeete""".split("|")]
MADE_UP_CITY = ["{}", "{}", "{}", "{} City", "Port {}", "San {}", "New {}", "{}ville", "{}burg", "Santa {}",
                "{} Springs", "Lake {}", "{} Bay", "St. {}", "Bad {}", "{}abad", "{}pur", "Puerto {}"]

COMPANIES = _items("""Google Siemens Samsung Tata_Consultancy_Services Banco_Santander Nokia Toyota Unilever
Safaricom Infosys Petrobras Dangote_Group Mercado_Libre Deutsche_Bahn Accenture Spotify Shopify Airbus Nestlé IKEA
Flutterwave Grab Ryanair Mayo_Clinic Red_Cross Doctors_Without_Borders Deloitte Ernst_&_Young Procter_&_Gamble
Johnson_&_Johnson H&M Marks_&_Spencer L'Oréal Société_Générale BNP_Paribas Volkswagen Telefónica Jollibee
Grupo_Bimbo Embraer Naspers MTN_Group Ecobank Jumia Ethiopian_Airlines Emirates Qatar_Airways Wipro Alibaba
Tencent Rakuten Hyundai LG_Electronics Foxconn Atlassian Canva Xero Air_New_Zealand Fonterra Maersk Novo_Nordisk
Ericsson Zalando SAP Heineken Carrefour Decathlon Michelin Renault Ferrero Pirelli Inditex Nubank Rappi Globant
Cemex Tokopedia Gojek Careem Paystack Equity_Bank UNICEF World_Health_Organization Ministry_of_Health""")
COMPANY_WORDS = _items("""Blue Northwind Summit Pioneer Evergreen Bright Atlas Cedar Maple River Falcon Horizon
Keystone Redwood Quantum Apex Lighthouse Golden Iron Oak Coastal Harbor Silverline Northstar Greenleaf Meridian
Crescent Sunrise Highland Prairie Beacon Pinnacle Orchard Granite Willow Crossroads Bluebird Riverside""")
COMPANY_SUFFIXES = _items("""Logistics Labs Systems Solutions Bank Bakery Consulting Media Foods Analytics Health
Motors Studios Partners Group Technologies Capital Energy Pharma Clinic Textiles Construction Insurance Airlines
Robotics Software Design Brewing Dairy Shipping Security Realty Outfitters Publishing Architects""")
LEGAL = _items("Ltd Ltd. Inc. LLC GmbH S.A. AG Corp. Co. B.V. S.p.A. Pty_Ltd PLC S.A.S. Oy AB")
SAINTS = _items("Luke Anne Jude Vincent Joseph Catherine Michael Francis Patrick Elizabeth Thomas Bernard Helen Peter")
INSTITUTIONS = [  # {w}: a word, {s}: a surname, {c}: a city, {t}: a saint, {x}: a suffix, {l}: a legal form
    "{w} {x}", "{w} {x}", "{w} {x} {l}", "{w} {x} {l}", "{w} {w2} {x}", "{w}{w2}", "{s} & Sons", "{s} & Partners",
    "{s} & Co.", "{s} {x}", "{s} {x} {l}", "{s}'s Bakery", "{c} Hospital", "{c} General Hospital",
    "St. {t}'s Hospital", "St. {t} Hospital", "{t} Medical Center", "{c} Children's Hospital",
    "{c} Medical Center", "Clínica {s}", "University of {c}", "{c} University", "{c} State University",
    "{s} University", "Technical University of {c}", "{c} Community College", "{s} High School",
    "{c} International School", "{w} Academy", "St. {t}'s Primary School", "Lycée {s}", "{w} Travel Agency",
    "{s} Realty", "{w} Books", "Café {w}", "{s}'s Deli", "{w} Dental Clinic", "{c} Public Library",
    "{c} City Council", "{w} Hotel", "Hotel {w}", "{c} Zoo", "{w} Bistro", "{c} Fire Department"]

DEPARTMENTS = _items("""marketing sales finance engineering operations HR logistics customer_success design product
research IT security procurement communications partnerships compliance facilities nursing admissions""")
ROLES = [r.strip() for r in """nurse|registered nurse|software engineer|software developer|data analyst|teacher|
primary school teacher|math teacher|chef|sous chef|head chef|line cook|accountant|pharmacist|electrician|graphic designer|
product manager|sales associate|sales representative|lawyer|attorney|paralegal|dentist|dental hygienist|mechanic|
civil engineer|mechanical engineer|electrical engineer|architect|barista|cashier|marketing manager|HR manager|HR assistant|
UX designer|UI designer|data scientist|web developer|frontend developer|backend developer|DevOps engineer|QA engineer|
project manager|truck driver|bus driver|delivery driver|receptionist|security guard|research scientist|lab technician|
financial analyst|customer support agent|customer service representative|social worker|physiotherapist|
occupational therapist|translator|interpreter|librarian|CEO|CTO|CFO|COO|founder|co-founder|operations director|
warehouse supervisor|warehouse worker|forklift operator|flight attendant|pilot|air traffic controller|veterinarian|vet tech|
plumber|carpenter|welder|photographer|video editor|editor|journalist|reporter|copywriter|surgeon|general practitioner|
pediatrician|midwife|paramedic|cook|driver|waiter|bartender|hotel manager|housekeeper|gardener|landscaper|farmer|tailor|
hairdresser|barber|makeup artist|personal trainer|yoga instructor|football coach|professor|lecturer|research assistant|
teaching assistant|school principal|tutor|consultant|management consultant|business analyst|systems administrator|
network engineer|security analyst|cloud architect|machine learning engineer|game designer|animator|illustrator|
interior designer|fashion designer|real estate agent|insurance broker|bank teller|loan officer|auditor|tax advisor|
economist|statistician|actuary|procurement officer|logistics coordinator|supply chain manager|store manager|
shift supervisor|office manager|executive assistant|community manager|social media manager|recruiter|police officer|
firefighter|diplomat|civil servant|urban planner|geologist|chemist|biologist|nutritionist|optician|radiologist|
anesthesiologist|psychologist|counselor|sommelier|baker|butcher|florist|jeweler|locksmith|roofer|sound engineer|DJ|musician|
piano teacher|nanny|caregiver|pharmacy technician|medical assistant|radiographer|data engineer|site reliability engineer|
product designer|technical writer|scrum master|program manager|account manager|account executive|brand manager|
event planner|travel agent|tour guide|ski instructor|lifeguard""".split("|")]
SENIORITY = _items("senior senior junior lead chief assistant principal staff associate deputy trainee")
DEPT_ROLES = ["head of {d}", "director of {d}", "VP of {d}", "{d} manager", "{d} coordinator", "{d} intern",
              "{d} lead", "{d} specialist", "{d} assistant"]

COLORS = [c.strip() for c in """red|blue|green|black|white|silver|yellow|orange|purple|gray|grey|pink|beige|navy|navy blue|
rose gold|matte black|sky blue|forest green|dark gray|light blue|burgundy|teal|charcoal|ivory|olive green|space gray|
midnight blue|cream|coral|turquoise|gold|bronze|lavender|mint green|crimson|brown|khaki|off-white|jet black|pearl white|
cherry red|sea foam green|burnt orange|dusty rose|sage green|royal blue|baby pink|hot pink|lime green|emerald green|
wine red|slate gray|graphite|titanium|champagne|sand|taupe|mauve|maroon|magenta|cyan|aqua|indigo|violet|lilac|peach|
mustard yellow|rust|copper|chrome|gunmetal gray|steel blue|powder blue|arctic white|phantom black|cobalt blue|sapphire blue|
ruby red|jade green|walnut brown|midnight green|blue-green|dark navy|light gray|pastel pink|bright red|deep purple|
heather gray|stone gray|olive|tan""".split("|")]
COLOR_RE = re.compile(r"(?<![\w-])(%s)(?![\w-])" % "|".join(map(re.escape, sorted(COLORS, key=len)[::-1])))
BRANDS = _items("""Nimbus Vortex Zenith Orion Kestrel Solaris Lumina Titan Nova Halcyon Vela Strata Polaris Arcadia
Vireo Quill Pebble Bosch Sony Philips Dyson Xiaomi Lenovo Canon Garmin Logitech Anker Tefal Samsung Apple Nikon
Brompton Asus Acer Dell HP Huawei Oppo Realme Tecno Fairphone JBL Bose Sennheiser Jabra Marshall Fender Yamaha
Casio Seiko Nike Adidas Puma Asics Salomon Patagonia Kärcher Miele Smeg De'Longhi Breville KitchenAid Nespresso
Moulinex Braun Panasonic Hisense Roborock Herman_Miller Trek Giant Peloton GoPro DJI Razer Corsair Keychron
Vitamix Osprey Samsonite Thule Hydro_Flask Coleman Bialetti Le_Creuset""")
LINES = _items("Aero Trail Flex Wave Pulse Edge Fold Spark Glide Swift Terra Vista Halo Echo Drift Core Prime Fusion")
MODELS = _items("Pro Mini Max Ultra Air Plus Lite GT SE One Neo Pro_Max Mk_II Mark_III Mark_IV Evo Classic")
NOUNS = [n.strip() for n in """headphones|wireless headphones|earbuds|sneakers|running shoes|hiking boots|sunglasses|
blender|laptop|gaming laptop|phone|smartphone|bicycle|road bike|mountain bike|electric scooter|standing desk|office chair|
gaming chair|coffee maker|espresso machine|backpack|wristwatch|smartwatch|fitness tracker|tablet|e-reader|camera|
mirrorless camera|action camera|drone|air fryer|vacuum cleaner|robot vacuum|toaster|kettle|electric kettle|desk lamp|
floor lamp|gaming mouse|wireless mouse|mechanical keyboard|monitor|printer|sofa|armchair|bookshelf|dining table|bed frame|
mattress|rice cooker|slow cooker|pressure cooker|stand mixer|food processor|hair dryer|hair straightener|
electric toothbrush|yoga mat|water bottle|thermos|tent|sleeping bag|guitar|electric guitar|ukulele|violin|suitcase|carry-on|
duffel bag|tote bag|handbag|wallet|rain jacket|winter coat|puffer jacket|hoodie|sweater|t-shirt|jeans|dress|scarf|helmet|
router|speaker|bluetooth speaker|soundbar|projector|microwave|fridge|washing machine|dishwasher|fan|space heater|humidifier|
air purifier|power bank|charger|USB hub|external hard drive|SSD|graphics card|game console|controller|VR headset|stroller|
car seat|skateboard|surfboard|kayak|treadmill|exercise bike|dumbbells|umbrella|phone case""".split("|")]
PLURAL = ("headphones", "earbuds", "sneakers", "shoes", "boots", "sunglasses", "jeans", "dumbbells")

# --- framing words: no digit and no value, so they never change the answer ---------------------
PREFIXES = _items("""so_basically fun_fact: by_the_way, just_so_you_know, FYI: FYI, update: note: quick_note: hey,
ok_so okay, for_the_record, heads_up: btw so well, news: reminder: hi! hello, to_be_clear, honestly, ok,
alright, um, hmm, so_yeah, right, quick_one: small_update: PS: just_an_fyi, good_news: oh_and ah, yo,
as_discussed, as_promised, following_up: also, update_-""")
OPENERS = {  # clauses before the facts, per schema
    "person": _items("""according_to_{her}_profile, from_the_sign-up_form: per_the_intake_form, as_of_today,
from_what_I_hear, if_I_remember_correctly, last_time_I_checked, at_the_reunion_I_learned_that
I_just_found_out_that turns_out apparently for_the_guest_list: for_the_member_directory: new_contact:
on_the_phone_{she}_told_me_that after_chatting_for_a_bit,_I_learned_that from_the_registration_desk:"""),
    "product": _items("""according_to_the_listing, from_the_catalog: per_the_website, as_of_this_morning,
spotted_online: saw_this_at_the_mall: in_the_shop_window: today's_deal: price_check: on_the_shelf:
from_the_flyer: the_store_says for_the_inventory: new_listing: found_it: deal_alert: just_checked_and"""),
    "employee": _items("""according_to_HR, per_the_staff_directory, from_{her}_profile: as_of_this_quarter,
for_the_staff_page: from_the_org_chart: new_employee_record: quick_HR_update: on_{her}_badge:
I_was_told_that from_what_I_hear, after_the_team_meeting,_I_learned_that according_to_{her}_résumé,""")}
FRAMES = [  # requests around a statement: "@" is the statement; a trailing "?" or "." ends it
    "please log this: @", "please add: @", "can you add this? @", "can you record that @?", "please note that @",
    "new entry: @", "add to the sheet: @", "save this for me: @", "could you store the following: @",
    "@ - please update the record.", "@. Can you log that?", "@ -- add it to the database please.",
    "could you make a note that @?", "pls add @", "log the following: @", "please remember that @.",
    "entry: @", "did you know that @?", "is it true that @?", "I heard that @.", "someone told me @.",
    "record: @", "data: @", "@ (please confirm)", "@. please save.", "for the CRM: @", "add a record: @",
    "create an entry: @", "update the file: @", "just so we have it on file: @", "memo: @", "ticket: @",
    "input: @", "text: @", "extract the details: @", "parse this: @", "@. Thanks!", "@. cheers",
]
KEYS = {  # key: value lines
        "name": "name|name|Name|full name|Full name|NAME|contact", "age": "age|age|Age|AGE|age (years)",
        "city": "city|city|City|location|hometown|lives in|based in|residence|town|from",
        "product": "product|item|Item|Product|model|article", "color": "color|colour|Color|finish|shade|colorway",
        "price": "price|price|Price|cost|asking|asking price|price tag|amount",
        "role": "role|position|title|job|Job title|occupation|works as", "years": "years|years|tenure|Tenure|"
        "years there|experience|years at company|service", "company": "company|employer|Company|organization|"
        "org|works at|workplace"}
MONEY = ("[${price}|${price}|${price}|${price}|{price} dollars|{price} bucks|{price} USD|USD {price}|US${price}|"
         "€{price}|€{price}|{price}€|{price} EUR|{price} euros|EUR {price}|£{price}|£{price}|{price} pounds|GBP {price}|"
         "¥{price}|{price} yen|₹{price}|Rs {price}|Rs. {price}|{price} rupees|CHF {price}|{price} CHF|{price} kr|"
         "{price} SEK|AUD {price}|A${price}|C${price}|CAD {price}|{price} pesos|MXN {price}|R${price}|₦{price}|"
         "{price} naira|KSh {price}|{price} zł|{price} PLN|₺{price}|{price} TL|{price}|{price}|{price} quid|{price},-|"
         "${price} flat|{price} dollars even]")  # currencies and their places, in the grammar's "[a|b]"
SUFFIXES = [", thanks", " lol", ", btw", " :)", ", I think", ", as far as I know", " thx", ", if that helps",
            " :D", ", right?", ", just FYI", " haha", ", I believe", " 👍", ", last I heard", ", apparently"]
CONTEXT = {schema: _items(text) for schema, text in zip(FIELDS, [
    """and_loves_hiking with_{her}_two_cats and_works_from_home and_plays_the_guitar and_speaks_three_languages
and_is_learning_to_code and_volunteers_on_weekends and_loves_cooking and_has_a_big_garden and_is_single
and_just_got_married and_has_a_rescue_dog and_is_looking_for_a_flatmate and_rides_a_motorbike
and_teaches_salsa and_is_a_huge_football_fan and_wants_to_travel_more and_is_vegetarian""",
    """with_free_shipping and_it_ships_worldwide in_great_condition barely_used brand_new_in_the_box
with_a_one-year_warranty and_it_makes_a_great_gift while_stocks_last plus_shipping tax_included
and_it's_in_stock no_box local_pickup_only price_is_firm obo or_best_offer and_it_has_great_reviews
with_the_original_receipt and_comes_with_a_case""",
    """and_loves_the_team and_mentors_new_hires and_enjoys_the_work and_works_remotely and_is_up_for_a_promotion
and_leads_the_night_shift and_rarely_takes_a_day_off and_is_well_liked and_speaks_at_conferences
and_trains_the_interns and_is_moving_to_a_new_role_soon and_just_got_a_raise"""])}
PREDICATES = {  # a main clause after an apposition: "X, 41, from Y, <pred>"
    "person": _items("""signed_up_for_the_newsletter joined_the_book_club is_looking_for_a_flatmate
called_about_the_apartment won_the_raffle applied_for_the_job is_on_the_guest_list registered_yesterday
just_adopted_a_puppy wants_a_callback booked_a_table_for_tonight"""),
    "product": _items("""sold_out_in_a_day is_back_in_stock arrived_today got_great_reviews is_our_best_seller
just_dropped is_on_my_wishlist is_the_one_I_want ships_next_week"""),
    "employee": _items("""just_got_promoted will_lead_the_new_project is_giving_a_talk_tomorrow is_retiring_soon
won_employee_of_the_month is_hiring_an_assistant signed_the_contract is_out_on_leave""")}
PRONOUNS = [dict(she="she", She="She", her="her", Her="Her", sib="sister", kin="aunt", one="a woman"),
            dict(she="he", She="He", her="his", Her="His", sib="brother", kin="uncle", one="a guy")]


UNWANTED = re.compile(r"^(four|five|nine|zero|seven|tene)s?$|rape|nazi|kike|pedo")  # numbers, slurs


# --- values ---------------------------------------------------------------------------------
def made_up(rng: random.Random, capitalized: bool) -> str:
    word = made_up_word(rng, capitalized)
    if len(word) < 4 or UNWANTED.search(word.lower()):  # short ones clash with "to", "so"
        return made_up(rng, capitalized)
    if rng.random() < 0.15:  # an accent to copy: "Brivéla"
        i = rng.randrange(len(word))
        word = word[:i] + {"a": "á", "e": "é", "o": "ö", "u": "ü", "i": "í"}.get(word[i], word[i]) + word[i + 1:]
    return word


def _title(text):
    return " ".join(w if w.isupper() or w in ("of", "and") else w[0].upper() + w[1:] for w in text.split())


def _surname(rng):
    return rng.choice(rng.choice(list(NAMES.values()))[1])


def name(rng: random.Random) -> str:
    if rng.random() < MADE_UP:
        return " ".join(made_up(rng, True) for _ in range(rng.choice([1, 2, 2, 2])))
    lang = rng.choice(sorted(NAMES))
    (firsts, lasts), r = NAMES[lang], rng.random()
    first, last = rng.choice(firsts), rng.choice(lasts)
    if r < 0.12:
        return first
    if r < 0.16:  # initials, as in forms: "J. Smith", "Amara K. Singh"
        return rng.choice([f"{first[0]}. {last}", f"{first} {rng.choice('ABCDEFGHJKLMNPRSTW')}. {last}"])
    if r < 0.2 and " " not in last:
        return f"{first} {last}-{rng.choice([n for n in lasts if ' ' not in n and n != last] or [last])}"
    if r < 0.82:
        return f"{last} {first}" if lang in SURNAME_FIRST and rng.random() < 0.3 else f"{first} {last}"
    double = lang in ("es", "pt")  # two surnames (Spanish, Portuguese) or two given names
    second = rng.choice([n for n in (lasts if double else firsts) if n not in (first, last)])
    out = f"{first} {last} {second}" if double else f"{first} {second} {last}"
    return out if len(out.split()) <= 5 else f"{first} {last}"


def city(rng: random.Random) -> str:
    if rng.random() < MADE_UP:
        return rng.choice(MADE_UP_CITY).format(made_up(rng, True))
    return rng.choice(CITIES)


def company(rng: random.Random) -> str:
    if rng.random() < MADE_UP:
        word = made_up(rng, True)
        return rng.choice([word, word, word + rng.choice(["ly", "ify", "io", "ex", "ora", "Tech", "Labs"]),
                           f"{word} {rng.choice(COMPANY_SUFFIXES)}", f"{word} {rng.choice(LEGAL)}", f"{word} & Co."])
    if rng.random() < 0.25:
        return rng.choice(COMPANIES)
    w, w2 = rng.sample(COMPANY_WORDS, 2)
    out = rng.choice(INSTITUTIONS).format(w=w, w2=w2, s=_surname(rng), c=city(rng), t=rng.choice(SAINTS),
                                          x=rng.choice(COMPANY_SUFFIXES), l=rng.choice(LEGAL))
    return out if len(out.split()) <= 5 else company(rng)


def role(rng: random.Random) -> str:
    if rng.random() < MADE_UP:
        out = made_up(rng, False) + rng.choice(["", "", " specialist", " technician", " officer", " operator",
                                                " manager", "ist"])
    elif rng.random() < 0.12:
        out = rng.choice(DEPT_ROLES).format(d=rng.choice(DEPARTMENTS))
    else:
        out = rng.choice(ROLES)
        if rng.random() < 0.2 and len(out.split()) < 3 and not out.isupper():
            out = f"{rng.choice(SENIORITY)} {out}"
    return _title(out) if rng.random() < 0.12 else out  # "Senior Data Analyst", as in signatures


def _code(rng):
    """A model code: "X2", "KX-200", "3000", "Pro 14", "Mk II", "V15"."""
    n, letters = rng.randint(1, 99), "XSZVGKMRTAEPQ"
    return rng.choice([f"{rng.choice(letters)}{n}", f"{rng.choice(letters)}{rng.choice(letters)}-{n}0",
                       f"{rng.randint(1, 9)}000", f"{rng.randint(1, 9)}00", str(rng.randint(2, 12)),
                       f"{rng.choice(MODELS)} {rng.randint(2, 16)}", f"{rng.choice(letters)}{n} Pro",
                       f"Gen {rng.randint(2, 5)}", f"v{rng.randint(2, 9)}", rng.choice(MODELS), rng.choice(MODELS)])


def product(rng: random.Random) -> str:
    """A noun ("standing desk"), brand + noun, brand + model code [+ noun], brand + line + noun."""
    noun, r = made_up(rng, False) if rng.random() < 0.1 else rng.choice(NOUNS), rng.random()
    if r < 0.15:
        return noun
    brand = rng.choice([made_up(rng, True), made_up(rng, True) + rng.choice(["ix", "o", "Tech", "ware"]),
                        rng.choice(BRANDS), rng.choice(BRANDS)])
    if r < 0.35:
        return f"{brand} {noun}"
    if r < 0.45:
        return f"{brand} {rng.choice(LINES)} {noun}"
    if r < 0.57:  # just brand and model: "Zenith X5"
        return f"{brand} {_code(rng)}"
    out = f"{brand} {rng.choice(LINES) + ' ' if r > 0.93 else ''}{_code(rng)} {noun}"
    return out if len(out.split()) <= 5 else f"{brand} {noun}"


def color(rng: random.Random) -> str:
    if rng.random() < MADE_UP / 2:
        return made_up(rng, False)
    out = rng.choice(COLORS)
    return _title(out) if rng.random() < 0.08 else out  # "Midnight Blue", as in listings


def values(schema: str, rng: random.Random) -> dict:
    """A random record of `schema`, fields in FIELDS's order."""
    ints = {f: rng.randint(*RANGES[f]) for f in FIELDS[schema] if f in RANGES}
    if schema == "product" and rng.random() < 0.7:  # most prices are everyday ones
        ints["price"] = rng.randint(5, 2000)
    if schema == "employee" and rng.random() < 0.6:  # most tenures are short
        ints["years"] = rng.randint(1, 15)
    make = {"name": name, "city": city, "company": company, "role": role, "product": product, "color": color}
    return {f: ints[f] if f in ints else make[f](rng) for f in FIELDS[schema]}
